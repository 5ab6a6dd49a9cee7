"""Function packages: per region and stage, the folder both platforms build an image from.

`regions/<region>/functions/<fn>/` holds the handler (OpenFaaS and Lambda entry points), the stage's
generated source and weights (safetensors), the loss module on the last stage, `function.json` (the
function's name and region and the whole workflow), the requirements, a Dockerfile for Lambda's
container image, and the vendored runtime: `cloudless/runtimes/function/` and `cloudless/runtimes/storage/`
(the worker and the storage channels: this project's folders of those names, whole) with the `cloudless/ir/`
modules they import (the workflow, the
schedule and the protocol: standard library and torch only), under the same import names as here. What the
images are built from (Python 3.12 on Amazon Linux 2023 for Lambda, on Debian bookworm for OpenFaaS) is
codegen/images.py's.

Requirements: every package comes from one index only, pinned (no --extra-index-url, under which pip
takes a name from whichever index offers the best version: dependency confusion). torch is the CPU
build from PyTorch's index; everything else comes from PyPI, pinned with every dependency (`PYPI_PINS`).
- `requirements-torch.txt` and `requirements-pypi.txt`: the Lambda image's two pip steps (Dockerfile),
  torch from PyTorch's CPU index (`--index-url`, its dependencies too), then the rest from PyPI with
  their hashes (`--require-hashes`).
- `requirements.txt`: what OpenFaaS's template installs, in one pip call, so one file: PyPI is its index,
  and torch is pinned to its `+cpu` build, which only PyTorch's page of torch builds (`--find-links`) has:
  PyPI refuses local versions like `+cpu`. No hashes: torch's cannot be known offline, and pip checks
  hashes for all of a call's packages or none.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources

import jinja2
import torch
from safetensors.torch import save

from ..ir.protocol import USER_FOLDER
from ..ir.workflow import Function, Workflow
from .images import LAMBDA_BASE_IMAGE, PYTHON_VERSION
from .libraries import library_imports, library_pins

#: PyTorch's index of CPU builds, and its page of torch's files: torch comes from there only (PyPI's torch
#: for Linux x86_64 is the CUDA build, gigabytes larger, and functions have no GPU)
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_PAGE = f"{TORCH_INDEX}/torch/"
#: every other package's only index
PYPI_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class Pin:
    """A pinned requirement from PyPI: its version, the sha256 of each wheel an image may install (CPython
    PYTHON_VERSION on manylinux x86_64 and aarch64; abi3 and pure-Python wheels serve every version) and,
    if it is not always needed, the environment marker."""

    name: str
    version: str
    hashes: tuple[str, ...]
    marker: str = ""


#: What a function imports besides torch (safetensors; boto3 and redis, the storage clients; braceexpand), with all of
#: their dependencies, pinned: known good together (and with torch 2.13); the hashes are PyPI's files'.
PYPI_PINS = (
    Pin(
        "safetensors",
        "0.8.0",
        (
            "fd6f3f93c9a0a7cc2788ee63fb763353d4bd2e89b0751bc78fcf7dda00bea774",  # manylinux x86_64
            "7a46e5ff292c356d6991e60942ba7f79817682d3a2cef0702136448cb9c4d235",  # manylinux aarch64
        ),
    ),
    Pin("boto3", "1.44.5", ("70c3e0409794b29ec1900bcaff0695b73234a2d32ffaed35045b94caa26212a5",)),
    Pin("botocore", "1.44.5", ("8f16a56d1dff125dd65322ae021efa7ba5195a6db5102b96862566055b748921",)),
    Pin("s3transfer", "0.19.3", ("24eb7535804306355e31c952a90022bf5b2f9d760f9a11062c7493a217c08553",)),
    Pin("jmespath", "1.1.0", ("a5663118de4908c91729bea0acadca56526eb2698e83de10cd116ae0f4e97c64",)),
    Pin("python-dateutil", "2.9.0.post0", ("a8b2bc7bffae282281c8140a97d3aa9c14da0b136dfe83f850eea9a5f7470427",)),
    Pin("six", "1.17.0", ("4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274",)),
    Pin("urllib3", "2.8.0", ("0cf3cae568d36aa9576b28dfb35f11328f1cb974ca7647d9475ebb86c75ac6e3",)),
    # redis needs async-timeout only before Python 3.11.3: not on the images' Python
    Pin("redis", "8.1.0", ("a4fe1aac3d3b3cc791d4b3d5931c5a956045dc951ee74d1c913ee3ac4d2ee9fb",)),
    # the shard names of training data where it lies (runtimes/storage/shards.py)
    Pin("braceexpand", "0.1.7", ("91332d53de7828103dcae5773fb43bc34950b0c8160e35e0f44c4427a3b85014",)),
)
#: a package's requirement files, by the template each is rendered from (and, when the stage calls a
#: library's ops, requirements-libraries.txt: the Lambda image's third pip step)
REQUIREMENT_FILES = ("requirements.txt", "requirements-torch.txt", "requirements-pypi.txt")
#: the PEP 508 marker values of the images' Python, for the library's requirements that apply there
IMAGE_MARKERS = {
    "python_version": PYTHON_VERSION,
    "python_full_version": f"{PYTHON_VERSION}.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
#: what the images install anyway: torch (its own step, with its dependencies) and the pinned packages
_INSTALLED_OTHERWISE = frozenset({"torch", *(pin.name for pin in PYPI_PINS)})
#: what a function runs: every module of these runtime folders (the stage worker and its parts, and the
#: storage channels it reads and writes through; the control plane, the clouds' drivers and the local clouds
#: stay out of the packages), and the ir modules they import (the run contract: standard library and torch)
VENDORED_FOLDERS = ("runtimes/function", "runtimes/storage")
VENDORED_IR = ("__init__", "protocol", "sample_order", "schedule", "workflow")


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
    """The vendored modules by path in a package (`cloudless/runtimes/function/worker.py`), in path order."""
    runtimes = resources.files("cloudless.runtimes")
    sources = {"cloudless/runtimes/__init__.py": runtimes.joinpath("__init__.py").read_bytes()}
    for folder in VENDORED_FOLDERS:
        package = resources.files("cloudless." + folder.replace("/", "."))
        for entry in package.iterdir():
            if entry.name.endswith(".py"):
                sources[f"cloudless/{folder}/{entry.name}"] = entry.read_bytes()
    ir = resources.files("cloudless.ir")
    for name in VENDORED_IR:
        sources[f"cloudless/ir/{name}.py"] = ir.joinpath(f"{name}.py").read_bytes()
    return dict(sorted(sources.items()))


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
    user_sources: dict[str, bytes] | None = None,
    user_imports: Sequence[str] = (),
) -> dict[str, bytes]:
    """The package's files, by path relative to the build folder. `user_sources`: the model file and its
    neighbours (by path relative to its folder), under `user/`: the functions import it for the user's
    own code a run calls (`transform`, `collate_fn`); `user_imports`: the third-party modules that code
    imports, whose packages the function installs as it does a library's."""
    stages = workflow.region(region).stages
    context = {
        "function": function.name,
        "region": region,
        "stage": function.stage,
        "stages": stages,
        "model": workflow.model,
        "python": PYTHON_VERSION,
        "base_image": LAMBDA_BASE_IMAGE,
        "torch_version": torch_version,
        "torch_index": TORCH_INDEX,
        "torch_page": TORCH_PAGE,
        "pypi_index": PYPI_INDEX,
        "pins": PYPI_PINS,
    }
    # the libraries whose ops or modules the stage (or its loss) uses, and those the user's code imports
    registering = sorted(
        {m for code in (stage_source, loss_source or "") for m in library_imports(code)} | set(user_imports)
    )
    libraries = library_pins(registering, IMAGE_MARKERS, _INSTALLED_OTHERWISE) if registering else ()
    context["libraries"] = libraries
    env = _environment()
    root = function.package
    requirement_files = REQUIREMENT_FILES + (("requirements-libraries.txt",) if libraries else ())
    files: dict[str, bytes] = {
        f"{root}/handler.py": env.get_template("handler.py.j2").render(context).encode(),
        f"{root}/Dockerfile": env.get_template("Dockerfile.j2").render(context).encode(),
        **{f"{root}/{name}": env.get_template(f"{name}.j2").render(context).encode() for name in requirement_files},
        f"{root}/stage.py": stage_source.encode(),
        # a staged build's parameters come from storage at run time, not from the package
        f"{root}/weights.safetensors": weights_bytes(
            {name: tensor for name, tensor in weights.items() if name not in dict(function.staged_parameters)}
        ),
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
    for name, data in (user_sources or {}).items():
        files[f"{root}/{USER_FOLDER}/{name}"] = data
    return files


def torch_release() -> str:
    """The torch release the stages were generated with (without a local build tag like +cpu)."""
    return torch.__version__.split("+")[0]
