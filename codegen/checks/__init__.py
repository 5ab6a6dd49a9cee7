"""The offline checks of a build folder, one module per family of files; cloudless.codegen.validate runs
them in order (check_build, check_deployment).

- base: BuildCheckError and its message, YAML and schema loading, the build folder and its manifest
- manifest: workflow.yaml (schema, DAG, batch sizes, stages, inputs, regions, optimizer, step replicas)
- plan: plan.json against workflow.yaml
- packages: the function packages (function.json, stage.py, weights, loss, tied parameters)
- openfaas: the OpenFaaS stack files and their images
- sam: samconfig.toml, the SAM templates, their Lambda functions, cfn-lint
- state_machine: the state machines and their definitions (statelint, Map concurrency, tasks)
- storage: each region's storage and its peers' (runs over several regions)
- digests: cloudless-build.json's digests, and no credentials in the deployment files
"""
