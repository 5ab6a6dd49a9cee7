"""Pre-flight (runtimes/clouds/preflight.py): Lambda quotas against a real HTTP server answering Lambda's own API, the
OpenFaaS cluster's capacity read by the real kubectl from a server answering the Kubernetes API, and image
visibility against a registry speaking the Docker Registry HTTP API v2 with its token service over TLS
(tests/preflight_servers.py). A failed pre-flight starts nothing: exit status 2, one line per failure."""

from __future__ import annotations

import re
import shutil
from decimal import Decimal
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

from cloudless.codegen.platforms import render_region
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.clouds import preflight
from cloudless.runtimes.clouds.preflight import (
    Node,
    Pod,
    anonymous_pull_problem,
    capacity_problems,
    cluster_capacity,
    image_reference,
    lambda_quotas,
    quantity,
)
from tests.preflight_servers import (
    kubeconfig,
    kubernetes_api,
    lambda_api,
    node,
    own_address,
    pod,
    registry_api,
    self_signed,
    serve,
)
from tests.test_platforms import EAST, RUN, WEST, make_workflow

GIB = 2**30


def test_kubernetes_quantities() -> None:
    assert quantity("3800m") == Decimal("3.8")
    assert quantity("16Gi") == 16 * GIB
    assert quantity("16302084Ki") == 16302084 * 1024
    assert quantity("1.5") == Decimal("1.5")
    assert quantity("128974848") == 128974848
    assert quantity("129e6") == 129_000_000
    assert quantity("1G") == 10**9 and quantity("2048Mi") == 2 * GIB
    with pytest.raises(ValueError, match="'lots': not a Kubernetes quantity"):
        quantity("lots")


def _clients(url: str) -> Any:
    return lambda aws: boto3.client("lambda", region_name=aws, endpoint_url=url)


def test_lambda_concurrency_below_the_plans_fails_naming_the_fix(aws_env: None) -> None:
    """aws-us-east-1 runs 1 + 2 + 4 workers at once, aws-eu-west-1 runs 2 (each its own AWS region)."""
    workflow = make_workflow()
    with serve(lambda_api(concurrency=10, unreserved=5, memory={})) as server:
        found = lambda_quotas(workflow, _clients(server.url))
    assert found.failures == [
        f"{EAST}: the plan runs 7 Lambda functions at once ({RUN}-s0 x1, {RUN}-s1 x2, {RUN}-s2 x4); the account has "
        "5 unreserved concurrent executions in us-east-1 (quota 10): request an increase of Lambda's Concurrent "
        f"executions (Service Quotas code L-B99A9384), or recompile with limits.max_functions: 5 for {EAST} in the "
        "catalog"
    ]
    # none above a new account's 3008 MB here: no memory notice
    assert found.notices == []
    with serve(lambda_api(concurrency=1000, unreserved=900, memory={})) as server:
        assert lambda_quotas(workflow, _clients(server.url)).failures == []


def test_deployed_memory_is_the_builds(aws_env: None) -> None:
    """A deployed function's MemorySize (what the account accepted) against the build's; one not deployed fails."""
    workflow = make_workflow()
    deployed = {EAST: {f.name: f"{f.name}-{EAST}" for f in workflow.region(EAST).functions}}
    memory = {f"{RUN}-s0-{EAST}": 1024, f"{RUN}-s1-{EAST}": 1769}  # s2 (3008 MB) is not deployed
    with serve(lambda_api(concurrency=1000, unreserved=1000, memory=memory | {f"{RUN}-s1-{EAST}": 1024})) as server:
        found = lambda_quotas(workflow, _clients(server.url), deployed)
    assert found.failures == [
        f"{EAST}: function {RUN}-s1 ({RUN}-s1-{EAST}) is deployed with 1024 MB; this build needs 1769 MB: deploy "
        f"this build (sam build --config-env {EAST} && sam deploy --config-env {EAST})",
        f"{EAST}: function {RUN}-s2: cannot read {RUN}-s2-{EAST}: An error occurred (ResourceNotFoundException) when "
        f"calling the GetFunctionConfiguration operation: Function not found: "
        f"arn:aws:lambda:us-east-1:123456789012:function:{RUN}-s2-{EAST}; deploy the build first",
    ]


def test_a_new_accounts_memory_is_a_notice(aws_env: None) -> None:
    """No API reports the memory quota: above 3008 MB on an account with a new account's concurrency, a notice."""
    workflow = make_workflow()
    big = workflow.region(EAST).functions[2]
    workflow = type(workflow).from_json(
        yaml.safe_load(yaml.safe_dump(workflow.to_json()).replace("memory_mb: 3008", "memory_mb: 10240"))
    )
    assert workflow.region(EAST).functions[2].memory_mb == 10240
    with serve(lambda_api(concurrency=10, unreserved=10, memory={})) as server:
        found = lambda_quotas(workflow, _clients(server.url))
    assert found.failures == []
    assert found.notices == [
        f"{EAST}: function {big.name} needs 10240 MB; this account's concurrency quota (10) is a new account's, whose "
        "memory quota is often 3008 MB (no API reports it): if sam deploy says MemorySize must be at most that, ask "
        "AWS support to raise it, or recompile with limits.max_memory_mb: 3008"
    ]


def test_nothing_starts_when_the_preflight_fails(
    two_stages, moto_endpoint: str, aws_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`cloudless-run --invoker lambda` checks first: short of concurrency, it stages nothing, invokes nothing,
    writes no output folder, and exits 2; `--preflight-only` says whether a run would start."""
    build, workflow, _ = two_stages
    region = workflow.regions[0].name
    first, second = workflow.regions[0].functions
    names = {f"{f.name}-{region}": f.memory_mb for f in workflow.regions[0].functions}
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # CloudFormation: no stack deployed
    out = tmp_path / "out"
    with serve(lambda_api(concurrency=10, unreserved=2, memory=names)) as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", server.url)
        code = run_main([str(build), "--invoker", "lambda", "--out", str(out), "--storage", str(tmp_path / "s")])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.splitlines() == [
            f"cloudless-run: pre-flight: {region}: the plan runs 3 Lambda functions at once ({first.name} x2, "
            f"{second.name} x1); the account has 2 unreserved concurrent executions in "
            f"us-east-1 (quota 10): request an increase of Lambda's Concurrent executions (Service Quotas code "
            f"L-B99A9384), or recompile with limits.max_functions: 2 for {region} in the catalog",
            "cloudless-run: pre-flight failed (1); nothing was started",
        ]
        assert not out.exists() and not (tmp_path / "s").exists()
        assert all(method == "GET" for method, _ in server.requests)  # read, never an invocation (POST)
        # before a deploy: the default stacks are not there yet (a notice), the quotas are checked
        code = run_main([str(build), "--invoker", "lambda", "--preflight-only"])
        captured = capsys.readouterr()
        assert code == 2 and "pre-flight failed (1)" in captured.err
        assert f"cloudless-run: pre-flight: --stack {workflow.run.name}-{region}: " in captured.err
    with serve(lambda_api(concurrency=1000, unreserved=1000, memory=names)) as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", server.url)
        assert run_main([str(build), "--invoker", "lambda", "--preflight-only"]) == 0
        captured = capsys.readouterr()
        assert (
            captured.out == "pre-flight passed for --invoker lambda (1 not checked, see above); nothing was started\n"
        )
    assert run_main([str(build), "--preflight-only"]) == 2
    assert "--preflight-only checks a deployment; give --invoker lambda or openfaas" in capsys.readouterr().err
    assert run_main([str(build), "--invoker", "lambda", "--openfaas-pro", "--preflight-only"]) == 2
    assert capsys.readouterr().err == "cloudless-run: --openfaas-pro: only with --invoker openfaas, not lambda\n"


# --- OpenFaaS capacity ----------------------------------------------------------------------------------

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def _stack(region: str = EAST) -> dict[str, Any]:
    """The generated stack: s0 1 x 1024Mi/1000m... (make_workflow's tiers, 1769 MB per vCPU)."""
    return yaml.safe_load(render_region(make_workflow(), region, {"openfaas"})[f"regions/{region}/stack.yaml"])


def test_the_stack_is_placed_onto_the_nodes_largest_first() -> None:
    pods = [Pod("a", Decimal(1), Decimal(3 * GIB))] * 2 + [Pod("b", Decimal("0.5"), Decimal(GIB))] * 3
    # 9 GiB asked, 10 GiB free, but in two nodes of 5: the two 3 GiB pods take one each, the rest fits
    assert (
        capacity_problems(
            "s", pods, [Node("n1", Decimal(4), Decimal(5 * GIB)), Node("n2", Decimal(4), Decimal(5 * GIB))], "r"
        )
        == []
    )
    # 9 GiB asked, 6.3 free in 2 nodes of 3.17 GiB: a 3 GiB pod each, then the 1 GiB pods find no room left
    nodes = [Node(f"n{i}", Decimal(4), Decimal(3.17 * GIB)) for i in range(3)]
    assert capacity_problems("s", pods, nodes[:2], "r") == [
        "s: the stack requests 9.0 GiB and 3.5 CPUs for 5 pods; the cluster's schedulable nodes have 6.3 GiB and 8 "
        "CPUs free (2 nodes; b's replicas do not all fit): add nodes, or recompile with a catalog limiting r's "
        "functions (limits.max_total_memory_mb, limits.max_functions, smaller tiers_mb)"
    ]
    assert capacity_problems("s", [Pod("big", Decimal(6), Decimal(10 * GIB))], nodes, "r") == [
        "s: function big requests 10.0 GiB and 6 CPUs per replica; the roomiest node (n2) has 3.2 GiB and 4 CPUs "
        "free: add nodes, or recompile with a catalog limiting r's functions (limits.max_total_memory_mb, "
        "limits.max_functions, smaller tiers_mb)"
    ]


@needs_kubectl
def test_cluster_capacity_read_with_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack asks 1 x 1024Mi + 2 x 1769Mi + 4 x 3008Mi (16.2 GiB) and 9.379 CPUs (1769 MB a vCPU). Not
    Ready, cordoned or tainted nodes take no pod; other pods' requests are taken off; the stack's own are not."""
    stack = _stack()
    nodes = [
        node("worker-1", "8", "12Gi"),
        node("worker-2", "4", "6Gi"),
        node("control-plane", "8", "64Gi", taint="NoSchedule"),
        node("down", "8", "64Gi", ready=False),
    ]
    pods = [
        pod("worker-1", "1", "2Gi"),  # another workload's
        pod("worker-2", "500m", "512Mi", phase="Succeeded"),  # finished: its requests are free again
        pod("worker-2", "2", "4Gi", function=f"{RUN}-s2"),  # the stack's own (a deploy replaces it)
    ]
    with serve(kubernetes_api(nodes, pods)) as server:
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", server.url)))
        found = cluster_capacity({EAST: stack}, None)
        assert found.notices == []
        assert found.failures == [
            f"regions/{EAST}/stack.yaml: the stack requests 16.2 GiB and 9.379 CPUs for 7 pods; the cluster's "
            "schedulable nodes have 16.0 GiB and 11 CPUs free (2 nodes; mlp-digits-s1's replicas do not all fit): "
            f"add nodes, or recompile with a catalog limiting {EAST}'s functions "
            "(limits.max_total_memory_mb, limits.max_functions, smaller tiers_mb)"
        ]
        assert ("GET", "/api/v1/nodes") in {(m, p.split("?")[0]) for m, p in server.requests}
    roomy = [node("worker-1", "16", "64Gi")]
    with serve(kubernetes_api(roomy, [])) as server:
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", server.url)))
        assert cluster_capacity({EAST: stack}, None).failures == []


def test_no_cluster_access_is_a_notice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    found = cluster_capacity({EAST: _stack()}, None)
    assert found.failures == []
    expected = "no cluster access is configured (KUBECONFIG, ~/.kube/config)"
    if shutil.which("kubectl") is None:
        expected = "kubectl is not installed"
    assert found.notices == [f"OpenFaaS capacity not checked: {expected}"]


# --- image visibility -----------------------------------------------------------------------------------


def test_image_references_as_docker_reads_them() -> None:
    assert image_reference("ghcr.io/acme/mlp-digits-s0:sha-1") == ("ghcr.io", "acme/mlp-digits-s0", "sha-1")
    assert image_reference("localhost:5000/mlp:1") == ("localhost:5000", "mlp", "1")
    assert image_reference("acme/mlp") == ("index.docker.io", "acme/mlp", "latest")
    assert image_reference("python") == ("index.docker.io", "library/python", "latest")
    assert image_reference("10.0.0.5:5000/a/b@sha256:ab") == ("10.0.0.5:5000", "a/b", "sha256:ab")


@pytest.mark.parametrize("registry", ["localhost:5000", "127.0.0.1:5000", "127.0.1.1", "[::1]:5000", "kind.localhost"])
def test_a_loopback_registry_is_refused_for_a_cluster(registry: str) -> None:
    problem = anonymous_pull_problem(f"{registry}/acme/mlp-digits-s0:sha-1")
    assert problem == (
        f"image {registry}/acme/mlp-digits-s0:sha-1: registry {registry} is this machine's loopback; faas-netes "
        "checks and pulls the image from inside the cluster, where that is the pod itself: push to a registry the "
        "cluster reaches (e.g. ghcr.io/<you>, public) and recompile with --registry"
    )


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A TLS registry on this machine's own (not loopback) address, its certificate trusted through
    SSL_CERT_FILE (OpenSSL's own variable); `acme/public` is public with tag v1, `acme/private` private."""
    address = own_address()
    if address is None or shutil.which("openssl") is None:
        pytest.skip("no non-loopback address or no openssl to serve a registry on")
    cert = self_signed(tmp_path, address)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert[0]))
    route = registry_api(public={"acme/public"}, tags={"acme/public": {"v1"}, "acme/private": {"v1"}})
    with serve(route, host=address, tls=cert) as server:
        yield server


def test_anonymous_pull_as_a_registry_client_does(registry: Any) -> None:
    host = registry.url.removeprefix("https://")
    assert anonymous_pull_problem(f"{host}/acme/public:v1") is None
    assert [(m, p.split("?")[0]) for m, p in registry.requests] == [
        ("HEAD", "/v2/acme/public/manifests/v1"),  # 401 and a Bearer challenge
        ("GET", "/token"),  # an anonymous token for repository:acme/public:pull
        ("HEAD", "/v2/acme/public/manifests/v1"),
    ]
    assert "scope=repository%3Aacme%2Fpublic%3Apull" in registry.requests[1][1]
    assert anonymous_pull_problem(f"{host}/acme/private:v1") == (
        f"image {host}/acme/private:v1: its token service refuses an anonymous pull (HTTP 401); OpenFaaS CE deploys "
        "only images it can pull anonymously: make the repository public, or run OpenFaaS Pro with a registry "
        "secret (then --openfaas-pro)"
    )
    assert anonymous_pull_problem(f"{host}/acme/public:v2") == (
        f"image {host}/acme/public:v2: not in {host} (HTTP 404): push it first (faas-cli push -f "
        "regions/<region>/stack.yaml)"
    )


def test_the_openfaas_preflight_checks_every_image_of_the_stack(
    registry: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every function's image of the build's stack files; --openfaas-pro checks none (Pro pulls with a secret)."""
    host = registry.url.removeprefix("https://")
    workflow = make_workflow()
    build = tmp_path / "build"
    for region in (EAST, WEST):
        files = render_region(workflow, region, {"openfaas"}, registry=f"{host}/acme")
        (build / "regions" / region).mkdir(parents=True)
        (build / "regions" / region / "stack.yaml").write_text(files[f"regions/{region}/stack.yaml"])
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    found = preflight.openfaas_preflight(build, workflow, None, pro=False)
    assert len(found.failures) == 5 and all("its token service refuses an anonymous pull" in f for f in found.failures)
    assert [re.search(r"/acme/([a-z0-9-]+):", f).group(1) for f in found.failures] == [  # type: ignore[union-attr]
        "mlp-digits-s0",
        "mlp-digits-s0",
        "mlp-digits-s1",
        "mlp-digits-s1",
        "mlp-digits-s2",
    ]
    assert preflight.openfaas_preflight(build, workflow, None, pro=True).failures == []


# --- what the compile warns of --------------------------------------------------------------------------


def test_the_compile_warns_of_new_account_quotas_and_a_small_cluster() -> None:
    """One line per file and kind, deterministic: functions above a new AWS account's 3008 MB, an iteration
    above its 10 concurrent executions, a stack beyond 3 nodes of 4 CPUs and 16 GiB."""
    from cloudless.codegen.checks.quotas import quota_warnings
    from cloudless.codegen.platforms import render_region as render

    small = make_workflow()
    files = {**render(small, EAST, {"sam", "openfaas"}), **render(small, WEST, {"sam", "openfaas"})}
    assert quota_warnings(files, small) == []
    big = type(small).from_json(
        yaml.safe_load(
            yaml.safe_dump(small.to_json())
            .replace("memory_mb: 3008", "memory_mb: 10240")
            .replace("cpu_millis: 1700", "cpu_millis: 5789")
            .replace("replicas: 4", "replicas: 9")
        )
    )
    files = {**render(big, EAST, {"sam", "openfaas"}), **render(big, WEST, {"sam", "openfaas"})}
    expected = [
        f"regions/{EAST}/stack.yaml: the stack requests 94.5 GiB and 54.68 CPUs (12 pods, the largest 10.0 GiB and "
        "5.789 CPUs); a small cluster (3 nodes of 4 CPUs and 16 GiB) holds 48 GiB and 12 CPUs: cloudless-run BUILD "
        "--invoker openfaas --preflight-only checks your cluster",
        f"regions/{EAST}/template.yaml: functions above a new AWS account's 3008 MB memory quota ({RUN}-s2-{EAST} "
        "10240 MB): sam deploy fails on such an account until AWS raises it; cloudless-run BUILD --invoker lambda "
        "--preflight-only reads your account's quotas",
        f"regions/{EAST}/template.yaml: an iteration runs 12 functions at once; a new AWS account runs 10 at once "
        "(its concurrency quota); cloudless-run BUILD --invoker lambda --preflight-only reads your account's quotas",
    ]
    assert quota_warnings(files, big) == expected
    assert quota_warnings(dict(reversed(files.items())), big) == expected  # in path order, whatever the order given
