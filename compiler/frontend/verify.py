"""Check that the generated stages, chained, reproduce the unsplit model.

The stages are built from their generated source and loaded with the model's weights, exactly as a
function would; the reference is the user's model in eager mode. Both run the same micro-batch
with the same seed (dropout draws match because the stages run the ops in the traced order).
Compared: the loss, every output, every parameter's gradient (a tied parameter's gradient is the
sum over the stages that hold it) and every buffer after the step (BatchNorm statistics).

The error of a tensor is max|stage - reference| / max(max|reference|, 1e-6): relative to the
tensor's scale, so that tiny gradients are not held to an absolute bar they cannot meet. The
tolerance, TOLERANCE, allows for float32 summation order; identical kernels give 0.

`check_stage_loads` is the load check every compile runs on the stages it writes (verified or
not): a generated module that does not load, or whose forward names something it does not hold, is
a compile error of one line, never a function's failure at run time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...codegen.libraries import library_imports, library_ops
from ..errors import CompileError, VerificationError, describe
from .chain import run_chain

TOLERANCE = 1e-4


@dataclass
class VerifyReport:
    loss_error: float = 0.0
    output_error: float = 0.0
    gradient_error: float = 0.0
    buffer_error: float = 0.0
    #: the outputs' largest error in eval mode (the stages' and the model's `.eval()`: what a run's test
    #: figures are computed in); not part of `max_error`: training is exact without it
    eval_error: float = 0.0
    worst_gradient: str = ""
    compared_gradients: int = 0
    stages: int = 0
    details: list[str] = field(default_factory=list)
    #: what was verified: the stages' block ranges, at which micro-batch, and why that split
    ranges: tuple[tuple[int, int], ...] = ()
    batch_size: int = 0
    split_from: str = ""

    @property
    def max_error(self) -> float:
        return max(self.loss_error, self.output_error, self.gradient_error, self.buffer_error)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    if got.shape != expected.shape:
        return float("inf")
    if not expected.is_floating_point():
        return 0.0 if torch.equal(got, expected) else float("inf")
    diff = (got.double() - expected.double()).abs().max().item() if got.numel() else 0.0
    scale = expected.double().abs().max().item() if expected.numel() else 0.0
    return diff / max(scale, 1e-6)


def load_stage(source: str, state: dict[str, torch.Tensor], name: str) -> nn.Module:
    """Instantiate a generated stage module from its source and weights."""
    namespace: dict[str, Any] = {"__name__": name}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    stage = namespace["Stage"]()
    stage.load_state_dict(state, strict=True)
    return stage


#: what a forward on the meta device raises when the code itself is wrong (a name or an attribute it
#: does not hold, a call with the wrong arguments); anything else may be the meta device's limits
#: (data-dependent code: `.item()`, a branch on a tensor's value), not the code's
_CODE_ERRORS = (NameError, AttributeError, ImportError, TypeError)


def check_stage_loads(
    source: str, state: dict[str, torch.Tensor], label: str, inputs: Sequence[Any] | None = None
) -> None:
    """Load a generated module as a function would: compile and run its source in a fresh namespace,
    instantiate `Stage` and load `state` (names, shapes and dtypes); with `inputs` (meta tensors, or
    None to skip), also run its forward on them. All on the meta device: no memory, no copy.
    CompileError naming `label` and the generated line if it fails."""
    name = f"generated {label}"
    try:
        namespace: dict[str, Any] = {"__name__": name.replace(" ", "_")}
        exec(compile(source, f"<{name}>", "exec"), namespace)
        with torch.device("meta"):
            stage = namespace["Stage"]()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # copying into a meta tensor does nothing: wanted
            stage.load_state_dict(state, strict=True)
        held = dict(stage.state_dict(keep_vars=True))
        for key, tensor in state.items():
            if held[key].dtype != tensor.dtype:
                raise TypeError(f"{key} is {str(held[key].dtype)} in the module, {str(tensor.dtype)} in the weights")
    except Exception as exc:
        raise CompileError(f"{label}: the generated module does not load: {_where(exc, name, source)}") from exc
    if inputs is None:
        return
    try:
        with torch.no_grad():
            stage(*inputs)
    except _CODE_ERRORS as exc:
        raise CompileError(f"{label}: the generated module's forward fails: {_where(exc, name, source)}") from exc
    except Exception:  # noqa: BLE001 - the meta device's limits, not the code's
        pass


#: run in a fresh interpreter: each generated module (a JSON list of [label, source]) is executed as its
#: function executes it, then every library op it calls is looked up; the first that fails is printed
_FRESH_CHECK = """
import json, re, sys
for label, source in json.load(sys.stdin):
    try:
        namespace = {"__name__": "stage"}
        exec(compile(source, "<" + label + ">", "exec"), namespace)
        import torch
        if "Stage" in namespace:  # builds its library modules, if any, from their classes
            with torch.device("meta"):
                namespace["Stage"]()
        for namespace, name in re.findall(r"\\btorch\\.ops\\.([A-Za-z_]\\w*)\\.([A-Za-z_]\\w*)", source):
            getattr(getattr(torch.ops, namespace), name)
    except Exception as exc:
        print(label + ": " + type(exc).__name__ + ": " + " ".join(str(exc).split()))
        sys.exit(1)
"""


def check_library_ops_resolve(modules: Sequence[tuple[str, str]]) -> None:
    """When a generated module calls a library's op (torch.ops outside torch's own namespaces) or
    rebuilds a library's module: load
    every module in a fresh interpreter, as a function does, and look each op up there, where only
    what the module imports is imported (this process has the model's libraries loaded: a stage that
    forgot one would pass here and fail in its function). CompileError naming the module and the op."""
    if not any(library_ops(source) or library_imports(source) for _, source in modules):
        return
    result = subprocess.run(
        [sys.executable, "-c", _FRESH_CHECK],
        input=json.dumps([list(m) for m in modules]),
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if result.returncode != 0:
        detail = ((result.stdout.strip() or result.stderr.strip()).splitlines() or ["no output"])[-1]
        raise CompileError(f"the generated code fails in a fresh interpreter, as in its function: {detail}")


def _where(exc: BaseException, name: str, source: str) -> str:
    """`ExceptionType: message`, and the generated line it was raised from."""
    text = describe(exc)
    if isinstance(exc, SyntaxError) and exc.filename == f"<{name}>":
        return f"{text} (line {exc.lineno})"
    lines = source.splitlines()
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename == f"<{name}>" and frame.lineno and 0 < frame.lineno <= len(lines):
            code = lines[frame.lineno - 1].strip().split(";")[0]
            return f"{text} (line {frame.lineno}: `{code}`)"
    return text


def verify_stages(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    targets: Any,
    loss_fn: Any,
    stages: list[tuple[str, dict[str, torch.Tensor], list[str], list[str]]],
    out_spec: pytree.TreeSpec,
    tolerance: float = TOLERANCE,
) -> VerifyReport:
    """`stages`: (source, state dict, input names, output names) per stage, in order.

    The reference is `model` itself (the caller restores its buffers); its gradients are cleared
    on return. Stage weights are copied in, so the stages never write to the model.
    """
    try:
        return _compare(model, example_inputs, targets, loss_fn, stages, out_spec, tolerance)
    finally:
        for param in model.parameters():
            param.grad = None


def _compare(
    reference: nn.Module, example_inputs: Any, targets: Any, loss_fn: Any, stages: Any, out_spec: Any, tolerance: float
) -> VerifyReport:
    for param in reference.parameters():
        param.grad = None
    # Load the stages first: their weights may alias the model's, whose buffers the reference run updates.
    modules = []
    for i, (source, state, _, _) in enumerate(stages):
        try:
            modules.append(load_stage(source, state, f"stage{i}"))
        except Exception as exc:
            where = _where(exc, f"stage{i}", source)
            raise CompileError(f"stage {i}: the generated module does not load: {where}") from exc
    torch.manual_seed(0)
    expected_out = reference(*example_inputs)
    expected_loss = loss_fn(expected_out, targets)
    expected_loss.backward()

    flat_inputs = pytree.tree_leaves(example_inputs)
    first_inputs = stages[0][2]
    torch.manual_seed(0)
    try:
        run = run_chain(
            modules,
            [(inputs, outputs) for _, _, inputs, outputs in stages],
            dict(zip(first_inputs, flat_inputs, strict=True)),
            lambda flat: loss_fn(pytree.tree_unflatten(list(flat), out_spec), targets),
        )
    except Exception as exc:
        frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
        failed = [i for i in range(len(stages)) if f"<stage{i}>" in frames]
        where = (
            f"stage {failed[-1]}: {_where(exc, f'stage{failed[-1]}', stages[failed[-1]][0])}"
            if failed
            else describe(exc)
        )
        raise VerificationError(
            f"{_the_stages(len(stages))} {'fails' if len(stages) == 1 else 'fail'} on the example micro-batch: {where}"
        ) from exc

    report = VerifyReport(stages=len(stages))
    report.loss_error = relative_error(run.loss, expected_loss.detach())
    expected_flat = [t for t in pytree.tree_leaves(expected_out) if isinstance(t, torch.Tensor)]
    got_flat = [t for t in run.outputs if isinstance(t, torch.Tensor)]
    if len(expected_flat) != len(got_flat):
        report.output_error = float("inf")
        report.details.append(f"{len(got_flat)} outputs, expected {len(expected_flat)}")
    for got, expected in zip(got_flat, expected_flat, strict=False):
        report.output_error = max(report.output_error, relative_error(got.detach(), expected.detach()))

    summed: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, param in module.named_parameters():
            if param.grad is not None:
                summed[name] = summed[name] + param.grad if name in summed else param.grad.clone()
        for name, buffer in module.named_buffers():
            buffers[name] = buffer
    reference_params = dict(reference.named_parameters())
    for name, param in reference_params.items():
        expected_grad = param.grad
        got_grad = summed.get(name)
        if expected_grad is None and got_grad is None:
            continue
        if expected_grad is None or got_grad is None:
            error = float("inf")
            report.details.append(f"{name}: gradient {'missing' if got_grad is None else 'unexpected'} in the stages")
        else:
            error = relative_error(got_grad, expected_grad)
        report.compared_gradients += 1
        if error >= report.gradient_error:
            report.gradient_error, report.worst_gradient = error, name
    reference_buffers = dict(reference.named_buffers())
    for name, buffer in buffers.items():
        if name in reference_buffers:
            report.buffer_error = max(report.buffer_error, relative_error(buffer, reference_buffers[name]))
    report.eval_error = _eval_error(reference, modules, stages, example_inputs)
    if report.max_error > tolerance:
        raise VerificationError(
            f"{_the_stages(len(stages))} {'does' if len(stages) == 1 else 'do'} not reproduce the model: "
            f"largest error {report.max_error:.3g} "
            f"(loss {report.loss_error:.3g}, outputs {report.output_error:.3g}, gradients "
            f"{report.gradient_error:.3g} at {report.worst_gradient or '-'}, buffers {report.buffer_error:.3g}) "
            f"exceeds the tolerance {tolerance:g}"
            + (f"; {'; '.join(report.details[:3])}" if report.details else "")
            + f". {_cause_and_fix(report)}"
        )
    return report


@torch.no_grad()
def _eval_error(reference: nn.Module, modules: list[nn.Module], stages: Any, example_inputs: Any) -> float:
    """The outputs' largest relative error in eval mode, the stages chained as in training (no buffer changes:
    eval mode updates none; the reference is put back in training mode)."""
    reference.eval()
    try:
        expected = [t for t in pytree.tree_leaves(reference(*example_inputs)) if isinstance(t, torch.Tensor)]
        values = dict(zip(stages[0][2], pytree.tree_leaves(example_inputs), strict=True))
        outputs: tuple[Any, ...] = ()
        for module, (_, _, inputs, names) in zip(modules, stages, strict=True):
            module.eval()
            outputs = tuple(module(*[values[n] for n in inputs]))
            values.update(zip(names, outputs, strict=True))
        got = [t for t in outputs if isinstance(t, torch.Tensor)]
    finally:
        reference.train()
    if len(got) != len(expected):
        return float("inf")
    return max((relative_error(g, e) for g, e in zip(got, expected, strict=True)), default=0.0)


def eval_warning(report: VerifyReport, tolerance: float = TOLERANCE) -> str | None:
    """What a user should know when the stages' eval mode is not the model's, or None."""
    if report.eval_error <= tolerance:
        return None
    return (
        f"in eval mode the stages' outputs differ from model.eval()'s (largest error {report.eval_error:.3g}): "
        "the model's code branches on self.training where the trace took the training branch, so a run's "
        "test figures are computed as in training mode there; training itself is exact"
    )


def _the_stages(count: int) -> str:
    return "the one stage" if count == 1 else f"the {count} stages"


def _cause_and_fix(report: VerifyReport) -> str:
    """The likely cause of a failed verification, from what differed, and what to do about it."""
    missing = [d.split(":")[0] for d in report.details if d.endswith("gradient missing in the stages")]
    unexpected = [d.split(":")[0] for d in report.details if d.endswith("gradient unexpected in the stages")]
    if missing:
        return (
            f"Cause: the stages give {missing[0]} no gradient, which the model gives one: the traced graph lost how "
            "the loss depends on it (a parameter read through .data or outside forward). Fix: use it in forward "
            "directly; if it must not train, requires_grad_(False) on it in build_model()"
        )
    if unexpected:
        return (
            f"Cause: the stages train {unexpected[0]}, which gets no gradient in the model (a no_grad region or a "
            "detach the trace did not keep). Fix: requires_grad_(False) on it in build_model() if it must not "
            "train, else compute it with plain torch operations"
        )
    if report.loss_error <= TOLERANCE and report.output_error <= TOLERANCE and report.gradient_error <= TOLERANCE:
        return (
            "Cause: only buffers differ: the model updates a buffer in another way than its traced operations "
            "(in place through Python state, or twice). Fix: update buffers with torch operations in forward"
        )
    return (
        "Cause: the stages compute other numbers than the model on the same micro-batch: randomness outside "
        "torch's generator (Python's random, numpy) or state the trace fixed at one value. Fix: draw random "
        "numbers with torch, compute from the inputs in forward; --no-verify skips the check"
    )
