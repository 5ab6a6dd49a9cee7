"""A staged build's weights: put into storage by the run, stage by stage, and read by the functions.

A model whose parameters take more than the compile's threshold (`cloudless-compile --weights`) is
built with no weights in its packages: each function lists its *staged* parameters
(`Function.staged_parameters`: its tensor name, the model's parameter name). Before the first
invocation, the run calls the model file's `build_model()` once — the same call, so the same weights,
as a plain PyTorch loop's: a seeded initialisation, or a checkpoint the model file loads — and puts each
stage's parameters into storage (`protocol.weights_key`), one stage at a time. A function reads its
package's tensors and its stage's staged ones, and nothing else.

Why the model never sits whole in memory while it is built: every parameter a module registers is
moved into a file of a scratch folder, mapped into memory (`ParameterFiles`), and a sweeper drops the
mapped pages from the process every fraction of a second. The kernel keeps what was written in its
page cache and writes it back to the file under pressure; the process's own memory holds a parameter
while it is initialised or loaded, and one stage while it is written out. Initialisation runs as it
would anywhere (the same ops, the same random generator), so the values are build_model()'s own.
"""

from __future__ import annotations

import json
import mmap
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ...ir import protocol
from ...ir.checkpoint_loading import checked_checkpoint_loads
from ...ir.workflow import Function, Region
from ..storage.channels import Channel

#: how often the sweeper drops the mapped parameter pages from the process
SWEEP_S = 0.2


class ParameterFiles:
    """Tensors kept in files of `folder`, each mapped into memory; `sweep()` drops their pages from the
    process (a shared file mapping loses nothing: the page cache holds what was written)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._maps: list[mmap.mmap] = []
        self._addresses: set[int] = set()
        self._lock = threading.Lock()

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._addresses

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` in a file of its own (a tensor of no bytes as it is)."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return tensor
        with self._lock:
            path = self.folder / f"t{len(self._maps):06d}"
            with path.open("w+b") as file:
                file.truncate(nbytes)
                mapped = mmap.mmap(file.fileno(), nbytes)
            self._maps.append(mapped)
            held = torch.frombuffer(mapped, dtype=tensor.dtype, count=tensor.numel()).view(tensor.shape)
            self._addresses.add(held.untyped_storage().data_ptr())
        held.copy_(tensor.detach())
        return held

    def sweep(self) -> None:
        with self._lock:
            maps = list(self._maps)
        for mapped in maps:
            mapped.madvise(mmap.MADV_DONTNEED)


@contextmanager
def parameters_in_files(folder: Path) -> Iterator[ParameterFiles]:
    """While open, the data of each CPU parameter a module registers is moved into a file of `folder`
    (`ParameterFiles.hold`); one already there (a tied weight registered again) stays itself. The
    sweeper runs until the context closes, and once more then."""
    files = ParameterFiles(folder)
    register = nn.Module.register_parameter

    def in_file(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type == "cpu" and not files.holds(param):
            # the modules registered before are built by now (a module initialises its parameters in its
            # own __init__): what they wrote leaves the process before the next parameter comes
            files.sweep()
            # the same Parameter, its data moved: whoever holds it, and its attributes (transformers
            # marks a loaded one `_is_hf_initialized`, so that its initialisation leaves it), stay
            param.data = files.hold(param.data)
        register(self, name, param)

    done = threading.Event()

    def sweeper() -> None:
        while not done.wait(SWEEP_S):
            files.sweep()

    thread = threading.Thread(target=sweeper, name="cloudless-weights-sweeper", daemon=True)
    nn.Module.register_parameter = in_file  # type: ignore[method-assign]
    thread.start()
    try:
        yield files
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
        done.set()
        thread.join()
        files.sweep()


def staged_functions(regions: Sequence[Region]) -> list[Function]:
    """The stage functions whose weights a run stages (each stage once: the regions share the split)."""
    seen: dict[str, Function] = {}
    for region in regions:
        for function in region.functions:
            if function.staged_parameters:
                seen.setdefault(function.name, function)
    return [seen[name] for name in sorted(seen)]


def stage_tensors(model: nn.Module, function: Function) -> dict[str, torch.Tensor]:
    """The function's staged parameters of `model`, by the stage's names (a tensor two names share,
    copied: safetensors holds each tensor's bytes once)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, source in function.staged_parameters:
        try:
            tensor = model.get_parameter(source).detach()
        except AttributeError as exc:
            raise ValueError(
                f"build_model() returned a model without the parameter {source!r} the build stages for "
                f"{function.name}: the model file changed since the compile (recompile)"
            ) from exc
        address = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if address in seen or not tensor.is_contiguous() else tensor
        seen.add(address)
    return tensors


#: safetensors' names of torch's dtypes
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def serialised(tensors: Mapping[str, torch.Tensor], after_each: Callable[[], None]) -> bytearray:
    """`tensors` in the safetensors format (what safetensors.torch.save writes), copied once each into
    the one buffer, calling `after_each` after each (the caller drops its pages): save() would hold a
    second copy of every tensor's bytes while it builds its own buffer."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    start = 8 + len(text)
    buffer = bytearray(start + offset)
    buffer[:start] = len(text).to_bytes(8, "little") + text
    view = memoryview(buffer)
    for name in sorted(tensors):
        first, stop = header[name]["data_offsets"]
        if stop > first:
            flat = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
            view[start + first : start + stop] = flat.numpy().data
        after_each()
    return buffer


@dataclass(frozen=True)
class StagedWeights:
    """What `stage_weights` did: the stages' functions, their bytes, the seconds it took."""

    functions: int
    bytes: int
    seconds: float


def stage_weights(
    model_module: ModuleType,
    regions: Sequence[Region],
    targets: Mapping[str, tuple[Channel, str]],
    scratch: Path | None = None,
) -> StagedWeights:
    """Build the model file's model once (`model_module.build_model()`, parameters in files of a scratch
    folder) and put each staged function's parameters, as safetensors, into every region's storage:
    `targets[region] = (channel, namespace)`. One stage's bytes in memory at a time."""
    functions = staged_functions(regions)
    began = time.perf_counter()
    total = 0
    if not functions:
        return StagedWeights(0, 0, 0.0)
    with tempfile.TemporaryDirectory(prefix="cloudless-weights-", dir=scratch) as folder:
        with checked_checkpoint_loads(), parameters_in_files(Path(folder)) as files:
            model = model_module.build_model()
        if not isinstance(model, nn.Module):
            raise ValueError(f"build_model() returned {type(model).__name__}; expected a torch.nn.Module")
        for function in functions:
            data = serialised(stage_tensors(model, function), files.sweep)
            for region in regions:
                if region.name in targets and any(f.name == function.name for f in region.functions):
                    channel, namespace = targets[region.name]
                    # a bytearray: every channel seals a value into new bytes first (protocol.seal)
                    channel.put(protocol.weights_key(namespace, function.name), cast(bytes, data))
            total += len(data)
            del data
        del model
    return StagedWeights(len(functions), total, time.perf_counter() - began)


#: what transformers names the index of a checkpoint written in shards (`load_sharded_checkpoint` reads it)
SHARD_INDEX = "model.safetensors.index.json"


def shard_names(count: int) -> list[str]:
    """transformers' names of a checkpoint's `count` shards: model-00001-of-00004.safetensors, ..."""
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def state_names(build: Path) -> dict[str, str]:
    """Per key of the user model's state_dict, the stages' name of its tensor (ir/graph.json's
    `state_names`; {} for a build without the graph, or from before it recorded them)."""
    graph = build / "ir" / "graph.json"
    names: dict[str, str] = json.loads(graph.read_text()).get("state_names") or {} if graph.is_file() else {}
    return names


def save_trained_model(out: Path, build: Path, regions: Sequence[Region], keyed: Mapping[str, torch.Tensor]) -> str:
    """Write the trained model (`keyed`: under the model's own names) into `out`: model.safetensors, or
    for a staged build one shard per stage and their index (`save_in_shards`). What was written, to print."""
    if not staged_functions(regions):
        save_file(dict(sorted(keyed.items())), str(out / "model.safetensors"))
        return "model.safetensors"
    first = regions[0]
    written = save_in_shards(out, keyed, state_names(build), stage_of_tensors(build, first), first.stages)
    return f"{written[0]} .. {written[-1]}"


def stage_of_tensors(build: Path, region: Region) -> dict[str, int]:
    """Per tensor name of the region's stages, the first stage holding it: its staged parameters and
    its package's tensors (only the files' headers are read)."""
    where: dict[str, int] = {}
    for function in region.functions:
        with safe_open(build / function.package / "weights.safetensors", "pt") as weights:
            names = list(weights.keys())
        for name in [source for source, _ in function.staged_parameters] + names:
            where.setdefault(name, function.stage)
    return where


def save_in_shards(
    out: Path, keyed: Mapping[str, torch.Tensor], sources: Mapping[str, str], stage_of: Mapping[str, int], stages: int
) -> list[str]:
    """The trained model as transformers writes a big checkpoint: one safetensors shard per stage (the
    tensors a stage holds, under the model's own names: `keyed`, each key's stage tensor in
    `sources`), and `model.safetensors.index.json` mapping every key to its shard. A key no stage holds
    goes with the last. The files written, index last."""
    names = shard_names(stages)
    by_shard: dict[str, dict[str, torch.Tensor]] = {name: {} for name in names}
    for key in sorted(keyed):
        by_shard[names[stage_of.get(sources.get(key, key), stages - 1)]][key] = keyed[key]
    weight_map: dict[str, str] = {}
    total = 0
    for name, tensors in by_shard.items():
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / SHARD_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, SHARD_INDEX]
