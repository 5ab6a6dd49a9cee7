"""The function packages: each holds what its worker loads (function.json, stage.py, the weights, the
loss module, the vendored runtime), as workflow.yaml describes it."""

from __future__ import annotations

import ast
import json
import math
import typing
from pathlib import Path
from typing import Any

from ...ir.protocol import USER_FOLDER
from ...ir.workflow import Function, Region, Workflow
from ...ir.workflow_rules import function_key
from ..libraries import (
    LibraryOpError,
    UserImportError,
    canonical_name,
    distribution_of,
    library_imports,
    third_party_imports,
    unimported_classes,
    unregistered_ops,
)
from ..package import runtime_sources
from ..stage_source import TensorKind
from .base import EDITED, MISSING, BuildContext, fail, shorten

#: safetensors dtype -> (the torch dtype name a generated stage's TENSORS gives, bytes per element)
_SAFETENSORS_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "C64": ("complex64", 8),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
#: a package's files besides stage.py, weights and the loss, and why each is needed
_PACKAGE_FILES = {
    "function.json": "the worker reads its function, region and workflow from it",
    "handler.py": "the function's entry point (Lambda's CMD, OpenFaaS's handler)",
    "stage.py": "the stage's generated module, which the worker runs",
    "weights.safetensors": "the stage's initial weights, which the worker loads at iteration 0",
    "requirements.txt": "the OpenFaaS image's dependencies",
    "requirements-torch.txt": "the Lambda image's torch (its Dockerfile's first pip step)",
    "requirements-pypi.txt": "the Lambda image's other dependencies (its Dockerfile's second pip step)",
    "Dockerfile": "what the Lambda image is built from",
}


def _first_difference(ours: Any, theirs: Any, where: str = "") -> tuple[str, Any, Any] | None:
    """The first key path (in `theirs`' order) at which two JSON documents differ, and both values."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in [*theirs, *(k for k in ours if k not in theirs)]:
            path = f"{where}/{key}" if where else str(key)
            if key not in ours or key not in theirs:
                return path, ours.get(key, MISSING), theirs.get(key, MISSING)
            found = _first_difference(ours[key], theirs[key], path)
            if found:
                return found
        return None
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            found = _first_difference(a, b, f"{where}/{index}" if where else str(index))
            if found:
                return found
        return None
    return None if ours == theirs else (where or "(top level)", ours, theirs)


#: a stage.py TENSORS entry: (shape, dtype, kind)
StageTensor = tuple[tuple[int, ...], str, TensorKind]
TENSOR_KINDS = typing.get_args(TensorKind)


def check_packages(context: BuildContext, document: dict[str, Any], workflow: Workflow) -> None:
    """Each function's package holds what its worker loads, as workflow.yaml describes it."""
    for r, region in enumerate(workflow.regions):
        tensors: dict[int, dict[str, StageTensor]] = {}
        for function in region.functions:
            last = function.stage == region.stages - 1
            _check_package_files(context, workflow, function, last)
            _check_function_json(context, document, workflow, region, function)
            tensors[function.stage] = _check_stage_module(context, document, r, function)
            _check_weights(context, function, tensors[function.stage])
            if last:
                _check_loss(context, workflow, function)
            _check_library_ops(context, workflow, function, last)
            _check_user_imports(context, workflow, function)
        _check_shared(context, document, r, region, tensors)
        _check_groups(workflow, tensors)


def _installed(context: BuildContext, function: Function) -> set[str]:
    """The distributions the package's requirements.txt pins, by canonical name."""
    return {
        canonical_name(line.split("==")[0])
        for line in (context.root / function.package / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }


def _check_library_ops(context: BuildContext, workflow: Workflow, function: Function, last: bool) -> None:
    """Every op the stage (and the loss) calls resolves in the function: torch's own, or a library's
    that a module the code imports registers, from a package requirements.txt installs; every library
    class it rebuilds is imported the same way."""
    installed = _installed(context, function)
    for name in ("stage.py", *([f"{workflow.data.loss}.py"] if last else [])):
        file = f"{function.package}/{name}"
        source = (context.root / file).read_text()
        unregistered = unregistered_ops(source)
        if unregistered:
            fail(
                file,
                "(imports)",
                f"calls {', '.join(unregistered)}, which nothing the file imports registers: the function would fail "
                f"at its first forward{context.note(file)}",
            )
        unimported = unimported_classes(source)
        if unimported:
            fail(
                file,
                "(imports)",
                f"rebuilds {', '.join(unimported)} without importing its module: the function would fail as it "
                f"starts{context.note(file)}",
            )
        for module in library_imports(source):
            try:
                distribution = distribution_of(module)
            except LibraryOpError:
                distribution = module.split(".")[0]
            if canonical_name(distribution) not in installed:
                fail(
                    f"{function.package}/requirements.txt",
                    distribution,
                    f"missing: {file} imports {module} (the stage calls its ops or runs its modules), which this "
                    f"package does not install{context.note(file)}",
                )


def _check_user_imports(context: BuildContext, workflow: Workflow, function: Function) -> None:
    """What the user's code under user/ imports (third_party_imports) the package installs."""
    folder = context.root / function.package / USER_FOLDER
    if not folder.is_dir():
        return
    sources = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*.py"))}
    installed = _installed(context, function)
    entry = Path(workflow.data.model_file).name
    try:
        modules = third_party_imports(sources, entry)
    except UserImportError as exc:
        fail(f"{function.package}/{USER_FOLDER}", "(imports)", str(exc))
    for module in modules:
        distribution = distribution_of(module)
        if canonical_name(distribution) not in installed:
            fail(
                f"{function.package}/requirements.txt",
                distribution,
                f"missing: {USER_FOLDER}/ imports {module} (the function runs its transform or collate_fn), which "
                "this package does not install",
            )


def _check_groups(workflow: Workflow, tensors: dict[int, dict[str, StageTensor]]) -> None:
    """With parameter groups, every parameter a stage trains is in one (a worker steps only those)."""
    if not workflow.optimizer.groups:
        return
    grouped = {name for group in workflow.optimizer.groups for name in group.parameters}
    for stage, held in sorted(tensors.items()):
        for name, (_, _, kind) in held.items():
            if kind == "parameter" and name not in grouped:
                fail(
                    "workflow.yaml",
                    "optimizer/groups",
                    f"stage {stage} trains {name!r}, which no parameter group holds",
                )


def _check_package_files(context: BuildContext, workflow: Workflow, function: Function, last: bool) -> None:
    folder = context.root / function.package
    if not folder.is_dir():
        fail(function.package, "(folder)", f"missing: the package of function {function.name!r}")
    needed = dict(_PACKAGE_FILES)
    if last:
        needed[f"{workflow.data.loss}.py"] = "the loss module, which the last stage runs"
    for path in runtime_sources():
        needed[path] = "part of the vendored runtime the handler imports"
    for name, why in needed.items():
        if not (folder / name).is_file():
            path = f"{function.package}/{name}"
            fail(path, "(file)", f"missing: {why}{_deleted(context, path)}")


def _deleted(context: BuildContext, path: str) -> str:
    return " (listed in cloudless-build.json: deleted after the compile; recompile)" if path in context.manifest else ""


def _check_function_json(
    context: BuildContext, document: dict[str, Any], workflow: Workflow, region: Region, function: Function
) -> None:
    """function.json names this function and region and holds workflow.yaml's workflow: the worker reads
    this copy, the controller workflow.yaml."""
    file = f"{function.package}/function.json"
    try:
        spec = json.loads((context.root / file).read_text())
    except ValueError as exc:
        fail(file, "(top level)", f"not JSON: {exc}{context.note(file)}")
    if not isinstance(spec, dict):
        fail(file, "(top level)", f"not an object{context.note(file)}")
    for key, name in (("function", function.name), ("region", region.name)):
        if spec.get(key) != name:
            found = shorten(spec.get(key, MISSING))
            fail(file, key, f"{found}; expected {name!r}, whose package this is{context.note(file)}")
    copy = spec.get("workflow", MISSING)
    try:
        typed = Workflow.from_json(copy)
    except (AttributeError, KeyError, TypeError, ValueError):
        ours, theirs = copy, document  # not a workflow: say where its document differs
    else:
        if typed == workflow:
            return
        ours, theirs = typed.to_json(), workflow.to_json()
    where, mine, expected = _first_difference(ours, theirs) or ("(top level)", copy, document)
    if context.culprit(file, "workflow.yaml") == file:
        fail(
            file,
            f"workflow/{where}" if where != "(top level)" else "workflow",
            f"{shorten(mine)}, but workflow.yaml has {shorten(expected)}: the worker reads this copy, the controller "
            f"workflow.yaml{context.note(file)}",
        )
    fail("workflow.yaml", where, f"{shorten(expected)}, but the packages' function.json have {shorten(mine)}{EDITED}")


def _module_constants(context: BuildContext, file: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The literal values a generated module assigns to `names`, read with ast (the build's code is not
    run), once it defines class Stage."""
    try:
        tree = ast.parse((context.root / file).read_text(), filename=file)
    except (SyntaxError, ValueError, UnicodeDecodeError) as exc:
        fail(file, "(top level)", f"not Python: {exc}{context.note(file)}")
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                try:
                    values[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    fail(file, node.targets[0].id, f"not a literal{context.note(file)}")
    if not any(isinstance(node, ast.ClassDef) and node.name == "Stage" for node in tree.body):
        fail(file, "Stage", f"missing: the worker instantiates class Stage{context.note(file)}")
    for name in names:
        if name not in values:
            fail(file, name, f"missing{context.note(file)}")
    return values


def _names(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, tuple | list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _check_stage_module(
    context: BuildContext, document: dict[str, Any], r: int, function: Function
) -> dict[str, StageTensor]:
    """stage.py's INPUTS and OUTPUTS are the function's (the worker takes and sends those); its TENSORS
    (name: (shape, dtype, kind)), which Stage() installs, are returned: its frozen parameters are the
    function's `frozen_parameters` (the worker neither trains, syncs nor checkpoints them)."""
    file = f"{function.package}/stage.py"
    constants = _module_constants(context, file, ("INPUTS", "OUTPUTS", "TENSORS"))
    key = function_key(document, r, function.name)
    for name, expected in (("INPUTS", function.inputs), ("OUTPUTS", function.outputs)):
        found = _names(constants[name])
        if found is None:
            fail(file, name, f"{shorten(constants[name])} is not a tuple of names{context.note(file)}")
        if found != expected:
            workflow_key = f"{key}/{name.lower()}"
            if context.culprit(file, "workflow.yaml") == file:
                fail(
                    file,
                    name,
                    f"{list(found)}, but workflow.yaml has {list(expected)} at {workflow_key}{context.note(file)}",
                )
            fail("workflow.yaml", workflow_key, f"{list(expected)}, but stage.py's {name} are {list(found)}{EDITED}")
    tensors = constants["TENSORS"]
    well_formed = isinstance(tensors, dict) and all(
        isinstance(name, str)
        and isinstance(entry, tuple)
        and len(entry) == 3
        and isinstance(entry[0], tuple)
        and all(isinstance(n, int) and n >= 0 for n in entry[0])
        and isinstance(entry[1], str)
        and entry[2] in TENSOR_KINDS
        for name, entry in tensors.items()
    )
    if not well_formed:
        kinds = " or ".join(repr(k) for k in TENSOR_KINDS)
        fail(file, "TENSORS", f"not {{name: (shape, dtype, kind)}} with kind {kinds}{context.note(file)}")
    frozen = tuple(name for name, (_, _, kind) in tensors.items() if kind == "frozen")
    if frozen != function.frozen_parameters:
        workflow_key = f"{key}/frozen_parameters"
        if context.culprit(file, "workflow.yaml") == file:
            fail(
                file,
                "TENSORS",
                f"frozen {list(frozen)}, but workflow.yaml has {list(function.frozen_parameters)} at "
                f"{workflow_key}{context.note(file)}",
            )
        fail(
            "workflow.yaml",
            workflow_key,
            f"{list(function.frozen_parameters)}, but stage.py's frozen TENSORS are {list(frozen)}{EDITED}",
        )
    return tensors


def _check_weights(context: BuildContext, function: Function, tensors: dict[str, StageTensor]) -> None:
    """weights.safetensors is whole (its header, and data to the last tensor's end) and holds exactly the
    tensors stage.py's TENSORS declares, with their shapes and dtypes, but the function's staged
    parameters (which the run stages into storage): the worker loads both with
    load_state_dict(strict=True) into Stage(), which installs TENSORS. Only the header is read."""
    file = f"{function.package}/weights.safetensors"
    stage = f"{function.package}/stage.py"
    note = context.note(file)
    path = context.root / file
    size = path.stat().st_size
    with path.open("rb") as stream:
        head = stream.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or length > size - 8:
            fail(file, "(header)", f"truncated or not safetensors: {size} bytes, header length {length}{note}")
        try:
            header = json.loads(stream.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            fail(file, "(header)", f"not a safetensors header (JSON): {exc}{note}")
    if not isinstance(header, dict):
        fail(file, "(header)", f"not a safetensors header (a JSON object){note}")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, itemsize = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            first, stop = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            fail(file, name, f"not a safetensors entry {{dtype, shape, data_offsets}}: {shorten(entry)}{note}")
        if not 0 <= first <= stop or stop - first != math.prod(shape) * itemsize:
            fail(file, name, f"data_offsets {[first, stop]} do not hold a {dtype} tensor of shape {list(shape)}{note}")
        found[name] = (shape, dtype)
        end = max(end, stop)
    data = size - 8 - length
    if end != data:
        what = "truncated" if end > data else "longer than its header says"
        fail(file, "(data)", f"{what}: the header describes {end} bytes of tensor data, the file holds {data}{note}")
    blamed = context.culprit(file, stage)
    staged = dict(function.staged_parameters)
    for name in staged:
        if name not in tensors:
            fail(stage, f"TENSORS/{name}", f"not declared, but workflow.yaml stages it as {staged[name]!r}{EDITED}")
        if name in found:
            fail(file, name, f"a staged parameter (the run brings its weights), but the package holds it{note}")
    for name, (shape, dtype, _) in tensors.items():
        if name in staged:
            continue
        if name not in found:
            if blamed == stage:
                fail(stage, f"TENSORS/{name}", f"not in weights.safetensors{EDITED}")
            fail(file, name, f"missing: stage.py's TENSORS declares it {list(shape)} {dtype}{note}")
        if found[name] != (shape, dtype):
            have = f"{list(found[name][0])} {found[name][1]}"
            if blamed == stage:
                fail(stage, f"TENSORS/{name}", f"{list(shape)} {dtype}, but weights.safetensors has {have}{EDITED}")
            fail(file, name, f"{have}, but stage.py's TENSORS declares {list(shape)} {dtype}{note}")
    for name in found:
        if name not in tensors:
            if blamed == stage:
                fail(stage, "TENSORS", f"lacks {name!r}, which weights.safetensors holds{EDITED}")
            fail(file, name, f"not a tensor of the stage (stage.py's TENSORS does not declare it){note}")


def _check_loss(context: BuildContext, workflow: Workflow, function: Function) -> None:
    """The loss module takes the last stage's outputs, then the targets: Stage()(*outputs, *targets)."""
    file = f"{function.package}/{workflow.data.loss}.py"
    constants = _module_constants(context, file, ("INPUTS",))
    inputs = _names(constants["INPUTS"])
    expected = len(function.outputs) + workflow.data.targets
    if inputs is None or len(inputs) != expected:
        if context.culprit(file, "workflow.yaml") == file:
            fail(
                file,
                "INPUTS",
                f"{shorten(constants['INPUTS'])}, but it takes the last stage's {len(function.outputs)} outputs and "
                f"data/targets {workflow.data.targets} targets{context.note(file)}",
            )
        fail(
            "workflow.yaml",
            "data/targets",
            f"{workflow.data.targets}, but {file} takes {len(inputs or ())} tensors, the last stage sends "
            f"{len(function.outputs)}{EDITED}",
        )


def _check_shared(
    context: BuildContext,
    document: dict[str, Any],
    r: int,
    region: Region,
    tensors: dict[int, dict[str, StageTensor]],
) -> None:
    """A tied parameter is a trainable tensor of every stage that lists it, and every stage holding it lists
    it: the stages that list it sum their gradients, and one left out would train its copy apart."""
    shared = {name for function in region.functions for name in function.shared_parameters}
    for function in region.functions:
        key = f"{function_key(document, r, function.name)}/shared_parameters"
        held = {name for name, (_, _, kind) in tensors[function.stage].items() if kind == "parameter"}
        for name in function.shared_parameters:
            if name not in held:
                fail(
                    "workflow.yaml",
                    key,
                    f"{name!r} is no trainable tensor of stage {function.stage} (its stage.py TENSORS)"
                    + context.was(key, list(function.shared_parameters)),
                )
        for name in sorted((shared & held) - set(function.shared_parameters)):
            fail(
                "workflow.yaml",
                key,
                f"stage {function.stage} holds the tied parameter {name!r}, which other stages list, but does "
                f"not list it: its gradient would not be summed{context.was(key, list(function.shared_parameters))}",
            )
