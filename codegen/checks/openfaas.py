"""The OpenFaaS stack files (regions/<region>/stack.yaml): each function of the region, its watchdog
timeouts, its image reference and its handler folder."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import yaml

from ...ir.catalog import OPENFAAS_CE_MAX_FUNCTIONS, OPENFAAS_CE_MAX_REPLICAS, registry_problem
from ...ir.workflow import Region
from .base import build_relative, fail, load_yaml, schema_check

#: an image reference's tag
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _seconds(duration: str) -> float:
    return sum(float(value) * _DURATION_UNITS[unit] for value, unit in _DURATION_PART.findall(duration))


def check_stack(build: Path, region: Region, packages: bool) -> None:
    path = build / "regions" / region.name / "stack.yaml"
    file = build_relative(build, path)
    stack = load_yaml(build, path)
    schema_check(stack, "openfaas-stack", file)
    expected = {f.name: f for f in region.functions}
    for name in stack["functions"]:
        if name not in expected:
            fail(file, f"functions/{name}", f"not a function of region {region.name!r} in workflow.yaml")
    for name in expected:
        if name not in stack["functions"]:
            fail(file, "functions", f"function {name!r} of workflow.yaml is missing")
    for name, function in stack["functions"].items():
        key = f"functions/{name}"
        environment = function.get("environment", {})
        for timeout in ("exec_timeout", "read_timeout", "write_timeout"):
            if timeout not in environment:
                # The watchdog's default (10 s) would cut a training step short.
                fail(file, f"{key}/environment/{timeout}", "missing")
        exec_s = _seconds(environment["exec_timeout"])
        if exec_s < expected[name].timeout_s:
            fail(
                file,
                f"{key}/environment/exec_timeout",
                f"{environment['exec_timeout']} is shorter than the function's timeout_s "
                f"{expected[name].timeout_s} in workflow.yaml",
            )
        for timeout in ("read_timeout", "write_timeout"):
            if _seconds(environment[timeout]) < exec_s:
                fail(
                    file,
                    f"{key}/environment/{timeout}",
                    f"{environment[timeout]} is shorter than exec_timeout {environment['exec_timeout']}: the "
                    "response of a handler using its whole time would be cut off",
                )
        _check_image(file, key, function["image"], name)
        labels = function.get("labels", {})
        low, high = labels.get("com.openfaas.scale.min"), labels.get("com.openfaas.scale.max")
        if low is not None and high is not None and int(low) > int(high):
            fail(file, f"{key}/labels/com.openfaas.scale.min", f"{low} exceeds com.openfaas.scale.max {high}")
        if packages:
            handler = (path.parent / function["handler"]).resolve()
            if not handler.is_dir():
                fail(file, f"{key}/handler", f"no folder {function['handler']!r} next to the stack file")
            for needed in ("handler.py", "requirements.txt"):
                if not (handler / needed).is_file():
                    fail(file, f"{key}/handler", f"{function['handler']!r} has no {needed}")


def split_image(image: str) -> tuple[str, str, str | None]:
    """An image reference `[<registry>/]<name>[:<tag>]` as (registry, name, tag); registry '' if none."""
    repository, tag = image, None
    if ":" in image.rsplit("/", 1)[-1]:
        repository, tag = image.rsplit(":", 1)
    registry, _, name = repository.rpartition("/")
    return registry, name, tag


def _check_image(file: str, key: str, image: str, function: str) -> None:
    """An image faas-cli can build, tag and push as written: `[<registry>/]<function>:<tag>`, with a tag of
    its own (faas-cli would add `:latest`, which names different images over time)."""
    registry, name, tag = split_image(image)
    if name != function:
        fail(file, f"{key}/image", f"{image!r}: the image of function {function!r} is named {function!r}")
    if tag is None or not _TAG.fullmatch(tag) or tag == "latest":
        fail(file, f"{key}/image", f"{image!r}: expected a tag naming the build (<name>:<tag>, not latest)")
    if registry:
        problem = registry_problem(registry)
        if problem:
            fail(file, f"{key}/image", f"{image!r}: the registry {registry!r} is {problem}")


def stack_warnings(stacks: Mapping[str, str]) -> list[str]:
    """`deployment_warnings` of OpenFaaS stack files given as {path in the build: text}, in path order."""
    found = []
    for file, text in sorted(stacks.items()):
        stack = yaml.safe_load(text)
        functions = stack.get("functions", {}) if isinstance(stack, dict) else {}
        bare = [name for name, function in functions.items() if not split_image(str(function.get("image")))[0]]
        if bare:
            found.append(
                f"{file}: the images have no registry ({functions[bare[0]]['image']}): faas-cli up fails at the "
                "push; compile with --registry (e.g. ghcr.io/<you>) or give the region a registry in the catalog"
            )
        if len(functions) > OPENFAAS_CE_MAX_FUNCTIONS:
            found.append(
                f"{file}: {len(functions)} functions; OpenFaaS CE deploys at most {OPENFAAS_CE_MAX_FUNCTIONS} "
                "(this stack needs OpenFaaS Pro)"
            )
        for name, function in functions.items():
            scale = function.get("labels", {}).get("com.openfaas.scale.max")
            if scale is not None and int(scale) > OPENFAAS_CE_MAX_REPLICAS:
                found.append(
                    f"{file}: function {name} scales to {scale} replicas; OpenFaaS CE allows at most "
                    f"{OPENFAAS_CE_MAX_REPLICAS} (this stack needs OpenFaaS Pro)"
                )
    return found
