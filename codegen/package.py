"""Function packages: per region and stage, the folder both platforms build an image from.

`regions/<region>/functions/<fn>/` holds the handler (OpenFaaS and Lambda entry points), the stage's
generated source and weights (safetensors), the loss module on the last stage, `function.json` (the
function's name and region and the whole workflow), `requirements.txt`, a Dockerfile for Lambda's
container image, and the vendored runtime: `cloudless/runtimes/` (this project's `runtimes/`, but
the controller and the local runner) with the `cloudless/ir/` modules it imports (the workflow, the
schedule and the protocol: standard library and torch only), under the same import names as here.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

import jinja2
import torch
from safetensors.torch import save

from cloudless.ir.workflow import Function, Workflow

PYTHON_VERSION = "3.11"
#: what a function runs, by package: the runtime modules (the controller and local runner stay out
#: of the packages) and the ir modules they import
VENDORED_MODULES = {
    "runtimes": ("__init__", "data", "emulation", "secrets", "storage", "sync", "tensors", "worker"),
    "ir": ("__init__", "protocol", "schedule", "workflow"),
}


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("cloudless.codegen", "templates/function"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


@cache
def runtime_sources() -> dict[str, bytes]:
    """The vendored modules by path in a package (`cloudless/<package>/<module>.py`)."""
    sources = {}
    for package, modules in VENDORED_MODULES.items():
        folder = resources.files(f"cloudless.{package}")
        for name in modules:
            sources[f"cloudless/{package}/{name}.py"] = folder.joinpath(f"{name}.py").read_bytes()
    return sources


def weights_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """The stage's tensors as safetensors (each its own copy: safetensors refuses shared storage)."""
    return save({name: tensor.detach().contiguous().clone() for name, tensor in sorted(state.items())})


def render_function_package(
    workflow: Workflow,
    region: str,
    function: Function,
    *,
    stage_source: str,
    weights: dict[str, torch.Tensor],
    loss_source: str | None,
    torch_version: str,
) -> dict[str, bytes]:
    """The package's files, by path relative to the build folder."""
    stages = workflow.region(region).stages
    context = {
        "function": function.name,
        "region": region,
        "stage": function.stage,
        "stages": stages,
        "model": workflow.model,
        "python": PYTHON_VERSION,
        "torch_version": torch_version,
    }
    env = _environment()
    root = function.package
    files: dict[str, bytes] = {
        f"{root}/handler.py": env.get_template("handler.py.j2").render(context).encode(),
        f"{root}/Dockerfile": env.get_template("Dockerfile.j2").render(context).encode(),
        f"{root}/requirements.txt": env.get_template("requirements.txt.j2").render(context).encode(),
        f"{root}/stage.py": stage_source.encode(),
        f"{root}/weights.safetensors": weights_bytes(weights),
        f"{root}/function.json": (
            json.dumps(
                {"function": function.name, "region": region, "workflow": workflow.to_json()}, indent=2, sort_keys=True
            )
            + "\n"
        ).encode(),
    }
    if function.stage == stages - 1:
        if loss_source is None:
            raise ValueError(f"{function.name} is the last stage and needs the loss module")
        files[f"{root}/{workflow.data.loss}.py"] = loss_source.encode()
    for name, data in runtime_sources().items():
        files[f"{root}/{name}"] = data
    return files


def torch_release() -> str:
    """The torch release the stages were generated with (without a local build tag like +cpu)."""
    return torch.__version__.split("+")[0]
