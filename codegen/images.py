"""What the functions' container images are built from, and what they are called.

Both platforms build one image per function package (`regions/<region>/functions/<fn>/`):
- AWS Lambda: the package's Dockerfile on AWS's Python base image `public.ecr.aws/lambda/python:3.12`,
  Amazon Linux 2023 with glibc 2.34 (the python3.11 image is Amazon Linux 2, glibc 2.26: torch 2.13's
  Linux wheels are manylinux_2_28 and need glibc 2.28, so pip finds no torch there). The image keeps AWS's
  conventions (github.com/aws/aws-lambda-base-images, Dockerfile.python3.12: `LAMBDA_TASK_ROOT=/var/task`,
  the entrypoint runs `CMD ["handler.handler"]`).
- OpenFaaS: faas-cli builds the `python3-http-debian` template (github.com/openfaas/python-flask-template,
  template/python3-http-debian/Dockerfile) with the package as its `function/` folder; the template's base is
  `python:${PYTHON_VERSION}-${DEBIAN_OS}`, and the stack file sets both build arguments (OPENFAAS_BUILD_ARGS)
  so that the image runs the same Python as Lambda's, on Debian bookworm (glibc 2.36), whatever the
  template's defaults.

Both install the requirements before they copy the package's code and weights (Lambda: the Dockerfile's
order; OpenFaaS: the template copies `function/requirements.txt` and installs it before `COPY function/`),
so new weights or code rebuild only the last layer, never torch's.

The pinned packages (codegen/package.py) must have wheels for PYTHON_VERSION on these C libraries:
tests/test_images.py resolves every generated requirements file for both platforms with pip's resolver.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from ..ir.catalog import registry_problem

#: the images' Python (major.minor), Lambda's and OpenFaaS's alike
PYTHON_VERSION = "3.12"
#: AWS's Lambda base image of that Python (Amazon Linux 2023)
LAMBDA_BASE_IMAGE = f"public.ecr.aws/lambda/python:{PYTHON_VERSION}"
#: the C library (glibc major, minor) of each platform's image, what its manylinux wheels may need
LAMBDA_GLIBC = (2, 34)  # Amazon Linux 2023
OPENFAAS_DEBIAN_OS = "slim-bookworm"
OPENFAAS_GLIBC = (2, 36)  # Debian 12 bookworm
#: the OpenFaaS template's build arguments (stack.yaml `build_args`): its base image's Python and Debian, and
#: no test run inside the image build (the template would run tox on the function's folder otherwise)
OPENFAAS_BUILD_ARGS = {
    "PYTHON_VERSION": PYTHON_VERSION,
    "DEBIAN_OS": OPENFAAS_DEBIAN_OS,
    "TEST_ENABLED": "false",
}
#: how many hex digits of the package's content digest tag its image
TAG_DIGITS = 12


def package_digest(files: Mapping[str, bytes], package: str) -> str:
    """The SHA-256 of a package folder's files (their paths inside it and their bytes, in path order):
    what its image is built from."""
    prefix = package.rstrip("/") + "/"
    digest = hashlib.sha256()
    for path in sorted(p for p in files if p.startswith(prefix)):
        data = files[path]
        name = path[len(prefix) :].encode()
        digest.update(len(name).to_bytes(8, "big") + name)
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def image_tag(files: Mapping[str, bytes], package: str) -> str:
    """The image tag of a package: `sha-` and the first TAG_DIGITS hex digits of its content digest.

    Deterministic, and new whenever anything the image holds changes (stage code, weights, the vendored
    runtime, the requirements): a redeploy of a changed build changes the function's image, so Kubernetes
    rolls the OpenFaaS function out (the same tag would leave the old pods running, and a moving tag like
    `latest` names different images over time), and two builds never overwrite each other's image."""
    return "sha-" + package_digest(files, package)[:TAG_DIGITS]


def image_name(function: str, tag: str, registry: str | None) -> str:
    """`<registry>/<function>:<tag>`, or `<function>:<tag>` without a registry (faas-cli then builds the
    image, but cannot push it). ValueError for a registry that is no image name prefix."""
    if registry is None:
        return f"{function}:{tag}"
    problem = registry_problem(registry)
    if problem:
        raise ValueError(f"registry {registry!r}: {problem}")
    return f"{registry}/{function}:{tag}"
