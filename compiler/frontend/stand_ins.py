"""Plan from shapes: the model's parameters as stand-ins, never its weights.

`build_model()` runs with every parameter sent to the meta device as it is registered (one
parameter's memory at a time; buffers stay real, their values matter: rotary frequencies, masks),
and each is then replaced by a *stand-in*: a real CPU parameter of its shape and dtype whose one
element is expanded (stride 0) over the shape. Tracing, annotation and the loss check run on
stand-ins as on weights: the graph, shapes, FLOPs, saved activations and bytes come out the same
(tests/test_stand_ins.py compares the annotated graphs), at one element per parameter.

Values are another matter: a kernel given a stride-0 weight may copy it first, which a timing would
count. The profile therefore materialises one block's parameters at a time (random values of their
shape and dtype), runs that block's forward and backward, and puts the stand-ins back
(`run_blocks_one_by_one`): peak memory follows the largest block, not the model, and a block holds
at most MAX_BLOCK_PARAM_BYTES of parameters (coarsen.py: a 70B model's blocks one layer each). Blocks
with the same operations on the same shapes are timed once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """While open, every parameter a module registers goes to the meta device."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


#: a model whose parameters take more bytes than this is compiled on stand-ins and its build holds no
#: parameter weights (`--weights auto`): the run stages them into storage, stage by stage
STAGED_WEIGHTS_BYTES = 2 << 30


def parameter_bytes(model: nn.Module) -> int:
    """The bytes `model`'s parameters take (a tied parameter once), whatever device they are on."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def staged_parameter_names(model: nn.Module, state: Mapping[str, torch.Tensor]) -> tuple[tuple[str, str], ...]:
    """Per tensor of a stage's `state` that is a parameter of `model` (the same storage): its name in
    the stage and the parameter's in the model (the first of a tied parameter's names), sorted."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(param.untyped_storage()._cdata, name)
    pairs = ((key, names.get(tensor.untyped_storage()._cdata)) for key, tensor in state.items())
    return tuple(sorted((key, name) for key, name in pairs if name is not None))


def stand_in(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `shape` and `dtype` holding one element (its own storage: tensors are told
    apart by their storage)."""
    return torch.zeros(1, dtype=dtype).expand(*shape) if len(shape) else torch.zeros((), dtype=dtype)


def replace_with_stand_ins(model: nn.Module) -> int:
    """Replace each meta parameter of `model` by a stand-in (a tied parameter by one stand-in); the
    bytes its weights would take."""
    made: dict[int, nn.Parameter] = {}
    total = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                made[id(param)] = nn.Parameter(stand_in(param.shape, param.dtype), requires_grad=param.requires_grad)
                total += param.numel() * param.element_size()
            module._parameters[name] = made[id(param)]
    return total


def is_stand_in(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 1 and tensor.untyped_storage().nbytes() <= tensor.element_size()


def holds_stand_ins(model: nn.Module) -> bool:
    """Whether `model` was built with stand-ins for its parameters (`replace_with_stand_ins`)."""
    return any(is_stand_in(p) for p in model.parameters())


#: the normal sample `random_fill` tiles: a prime count, so that no row of a weight repeats another
_SAMPLE = 1_000_003


@cache
def _normal_sample(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(_SAMPLE, generator=torch.Generator().manual_seed(0)).to(dtype)


def random_fill(tensor: torch.Tensor) -> None:
    """Fill a contiguous floating-point `tensor` with a fixed normal sample, tiled."""
    flat, sample = tensor.view(-1), _normal_sample(tensor.dtype)
    whole = flat.numel() // _SAMPLE * _SAMPLE
    if whole:
        flat[:whole].view(-1, _SAMPLE).copy_(sample)
    flat[whole:].copy_(sample[: flat.numel() - whole])


@contextmanager
def materialised(parameters: Sequence[torch.Tensor]) -> Iterator[None]:
    """While open, each stand-in among `parameters` holds random values of its shape (a normal
    sample, tiled: what a kernel computes on does not change its time, and drawing a billion
    normals takes seconds where a copy takes a fraction); the stand-ins come back after."""
    swapped = []
    for param in dict.fromkeys(parameters):  # a tied parameter once
        if is_stand_in(param):
            real = torch.empty(param.shape, dtype=param.dtype)
            random_fill(real) if real.is_floating_point() else real.zero_()
            swapped.append((param, param.data))
            param.data = real
    try:
        yield
    finally:
        for param, data in swapped:
            param.data = data
            param.grad = None


def _received(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value.detach() if isinstance(value, torch.Tensor) else value


def run_blocks_one_by_one(
    stages: Sequence[Callable[..., tuple[Any, ...]]],
    signatures: Sequence[tuple[Sequence[str], Sequence[str]]],
    parameters: Sequence[Sequence[torch.Tensor]],
    keys: Sequence[Any],
    model_inputs: dict[str, Any],
    loss_of: Callable[[tuple[Any, ...]], torch.Tensor],
) -> tuple[list[float], list[float]]:
    """Each stage's forward and backward seconds, one stage at a time with its `parameters`
    materialised: its forward on the previous stage's outputs, then its backward from the loss (the
    last) or from a gradient of ones for its outputs. A stage whose key an earlier stage had is not
    run: it takes that stage's times, and its outputs (of the same shapes) go on to the next."""
    values: dict[str, Any] = dict(model_inputs)
    forward_s: list[float] = []
    backward_s: list[float] = []
    #: key -> the times of the first stage with it, and its outputs (what the next stage takes)
    timed: dict[Any, tuple[float, float, tuple[Any, ...]]] = {}
    for s, (stage, (inputs, outputs)) in enumerate(zip(stages, signatures, strict=True)):
        last = s == len(stages) - 1
        key = (keys[s], len(inputs), len(outputs))
        if key in timed and not last:  # an identical block: its times, and outputs of its shapes
            f, b, result = timed[key]
        else:
            taken = [values[name] if s == 0 else _received(values[name]) for name in inputs]
            with materialised(parameters[s]):
                start = time.perf_counter()
                result = tuple(stage(*taken))
                loss = loss_of(result) if last else None
                f = time.perf_counter() - start
                tensors = [loss] if loss is not None else [r for r in result if _differentiable(r)]
                start = time.perf_counter()
                if tensors:
                    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])
                b = time.perf_counter() - start
            del taken, tensors, loss
            result = tuple(_received(value) for value in result)
            timed[key] = (f, b, result)
        forward_s.append(f)
        backward_s.append(b)
        values = dict(zip(outputs, result, strict=True)) if not last else {}
    return forward_s, backward_s


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad
