"""Putting a region's training data into storage, and evaluating a trained run on its test split.

The data comes from the user's model file: `load_shard(region, split)` returns a torch Dataset whose
items are (inputs, target), each a tensor or a nested structure of tensors. It is written per
storage (`protocol.data_key`, see data.py) and shared by the runs that use that storage; each run
fingerprints what load_shard gives and re-stages a split whose stored content differs.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib.util
import itertools
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypedDict

import torch
from torch.utils import _pytree as pytree

from ...ir import protocol
from ...ir.protocol import DATA_META, data_key
from ...ir.sample_order import SHUFFLE_SHARDS, staging_order
from ...ir.workflow import DataSource, Region, Workflow
from ..function.batches import open_batches, user_module
from ..function.data import FINGERPRINT_PREFIX, Staging, WrittenSplit, read_meta, remove_split, write_split
from ..function.initial_weights import package_weights
from ..function.worker import load_module, load_stage_module
from ..storage.channels import Channel
from ..storage.objects import ObjectError
from ..storage.shards import (
    IN_PLACE_FORMATS,
    Members,
    ShardEntry,
    ShardError,
    in_place_pattern,
    index_split,
)
from ..storage.tensors import autocast, unpack
from .staged_weights import stage_weights, staged_functions, state_names


class DataError(ValueError):
    """The model file cannot give the data a run needs."""


def load_model_module(path: Path) -> ModuleType:
    if not path.is_file():
        raise DataError(f"{path}: no such model file (pass --model MODEL.py, the file the build was compiled from)")
    spec = importlib.util.spec_from_file_location(f"cloudless_data_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise DataError(f"{path}: cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))  # the model file may import its neighbours
    # Nothing is left in the user's folder: no __pycache__ beside the model file or its neighbours.
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise DataError(f"{path}: importing it failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.pop(0)
        sys.dont_write_bytecode = writes_bytecode
    if not callable(getattr(module, "load_shard", None)):
        raise DataError(f"{path}: defines no load_shard(region, split); a run needs it to read its training data")
    return module


def _leaf_specs(example: Any) -> list[tuple[str, tuple[int, ...]] | type]:
    """Per leaf of a batch from example_inputs / example_targets: a tensor's dtype and shape without
    the batch dimension (what one sample of the data must have), else the leaf's type."""
    return [
        (str(leaf.dtype).removeprefix("torch."), tuple(leaf.shape[1:]))
        if isinstance(leaf, torch.Tensor)
        else type(leaf)
        for leaf in pytree.tree_leaves(example)
    ]


def _mismatch(what: str, leaves: list[Any], expected: list[tuple[str, tuple[int, ...]] | type]) -> str | None:
    """How one sample's `leaves` differ from what the example batch says, or None."""
    if len(leaves) != len(expected):
        return f"{len(leaves)} {what} tensors, but the example gives {len(expected)}"
    for index, (leaf, spec) in enumerate(zip(leaves, expected, strict=True)):
        if isinstance(spec, tuple):
            if not isinstance(leaf, torch.Tensor):
                return f"{what} {index} is a {type(leaf).__name__}, but the example's is a tensor"
            found = (str(leaf.dtype).removeprefix("torch."), tuple(leaf.shape))
            if found != spec:
                return (
                    f"{what} {index} is {found[0]} of shape {list(found[1])}, but the example's is {spec[0]} of shape "
                    f"{list(spec[1])} (without the batch dimension)"
                )
        elif not isinstance(leaf, spec):
            return f"{what} {index} is a {type(leaf).__name__}, but the example's is a {spec.__name__}"
    return None


def _load_shard(module: ModuleType, path: Path, region: str, split: str) -> Any:
    try:
        return module.load_shard(region, split)
    except Exception as exc:
        raise DataError(f"{path}: load_shard({region!r}, {split!r}) failed: {type(exc).__name__}: {exc}") from exc


def _samples(
    module: ModuleType,
    path: Path,
    split: str,
    parts: Sequence[tuple[str, int, int | None]],
    dataset: Any = None,
) -> Any:
    """The samples of `parts`, each (region, first, count): load_shard(region, split)'s samples
    first..first+count-1 (count None: to its end), as (flat inputs, flat targets), each checked against what
    example_inputs and example_targets give (one sample of the batch): data that does not fit the compiled
    stages is an error here, naming the sample, not at a function's first step. A train split of map-style
    datasets comes in `sample_order.staging_order` over the parts' samples together (what its shards hold);
    a stream as it comes, read once. `dataset`: load_shard's for the one part, when the caller has it."""
    shuffled = split == "train"
    try:
        opened: list[tuple[str, Any, int, int | None]] = []
        any_streamed = False
        for region, first, count in parts:
            given = dataset if dataset is not None and len(parts) == 1 else module.load_shard(region, split)
            # a stream (an IterableDataset, a generator) is read as it comes, once: bounded memory whatever its size
            streamed = isinstance(given, torch.utils.data.IterableDataset) or not hasattr(given, "__getitem__")
            stop = None if count is None else first + count
            if not streamed:
                stop = len(given) if stop is None else stop
                if stop > len(given):
                    raise ValueError(f"samples {first}..{stop - 1} were planned, but it has {len(given)}")
            opened.append((region, given, first, stop))
            any_streamed = any_streamed or streamed
        make_inputs, make_targets = getattr(module, "example_inputs", None), getattr(module, "example_targets", None)
        example = make_inputs(1) if make_inputs is not None else None
        # keyword inputs (example_inputs returns a dict): a dict row gives them by name
        keywords = tuple(example) if isinstance(example, Mapping) else ()
        expected_inputs = _leaf_specs(example) if example is not None else None
        expected_targets = _leaf_specs(make_targets(1)) if make_targets is not None else None
    except Exception as exc:
        region = parts[len(opened)][0] if len(opened) < len(parts) else parts[0][0]
        raise DataError(f"{path}: load_shard({region!r}, {split!r}) failed: {type(exc).__name__}: {exc}") from exc
    if any_streamed:
        items: Iterator[tuple[str, int, Any]] = _streamed(path, split, opened)
    else:
        items = _indexed(opened, shuffled)
    while True:
        try:
            region, i, item = next(items)
        except StopIteration:
            break
        except _ItemFailed as failed:
            what = f"load_shard({failed.region!r}, {split!r})[{failed.index}] failed: {failed.error}"
            raise DataError(f"{path}: {what}") from failed.__cause__
        where = f"load_shard({region!r}, {split!r})[{i}]"
        inputs, target = _inputs_and_target(module, path, where, item, keywords)
        sample = pytree.tree_leaves(inputs), pytree.tree_leaves(target)
        wrong = _mismatch("input", sample[0], expected_inputs) if expected_inputs is not None else None
        if wrong is None and expected_targets is not None:
            wrong = _mismatch("target", sample[1], expected_targets)
        if wrong is not None:
            raise DataError(f"{path}: {where}: {wrong}")
        yield sample


class _ItemFailed(Exception):
    """A dataset's item raised: which region's, which index, and what."""

    def __init__(self, region: str, index: int, exc: Exception) -> None:
        super().__init__(region, index)
        self.region, self.index, self.error = region, index, f"{type(exc).__name__}: {exc}"


def _streamed(path: Path, split: str, opened: list[tuple[str, Any, int, int | None]]) -> Iterator[tuple[str, int, Any]]:
    """The parts' items as they come (a stream is read once), each with its region and index."""
    for region, given, first, stop in opened:
        i = first
        try:
            if isinstance(given, torch.utils.data.IterableDataset) or not hasattr(given, "__getitem__"):
                stream: Iterator[Any] = itertools.islice(iter(given), first, stop)
            else:
                stream = (given[j] for j in range(first, int(stop or 0)))
            while True:
                try:
                    item = next(stream)
                except StopIteration:
                    break
                yield region, i, item
                i += 1
        except Exception as exc:
            raise _ItemFailed(region, i, exc) from exc
        if stop is not None and i < stop:
            raise DataError(
                f"{path}: load_shard({region!r}, {split!r}): samples {first}..{stop - 1} were planned, but it gave {i}"
            )


def _indexed(opened: list[tuple[str, Any, int, int | None]], shuffled: bool) -> Iterator[tuple[str, int, Any]]:
    """The parts' items of map-style datasets, in `staging_order` over all of them when `shuffled`."""
    starts = list(itertools.accumulate((int(stop or 0) - first for _, _, first, stop in opened), initial=0))
    total = starts[-1]
    rows = staging_order(total) if shuffled else torch.arange(total)
    for row in range(total):
        position = int(rows[row])
        part = bisect.bisect_right(starts, position) - 1
        region, given, first, _ = opened[part]
        i = first + position - starts[part]
        try:
            item = given[i]
        except Exception as exc:
            raise _ItemFailed(region, i, exc) from exc
        yield region, i, item


#: the model file's mapping of a dict row (a Hugging Face `datasets.Dataset`'s) to inputs and target
DATA_COLUMNS = "DATA_COLUMNS"


def _inputs_and_target(
    module: ModuleType, path: Path, where: str, item: Any, keywords: tuple[str, ...] = ()
) -> tuple[Any, Any]:
    """A dataset's item as (inputs, target): a pair as it is; a dict row by the model file's DATA_COLUMNS,
    `{"inputs": [column, ...], "target": column}` (columns of lists become tensors; a target None: no target,
    the model computes its loss), else, for a model of keyword inputs, by their names, without a target."""
    if isinstance(item, Mapping):
        columns = getattr(module, DATA_COLUMNS, None)
        if columns is None and keywords:
            columns = {"inputs": list(keywords), "target": None}
        if not (
            isinstance(columns, Mapping) and isinstance(columns.get("inputs"), (list, tuple)) and "target" in columns
        ):
            raise DataError(
                f"{path}: {where} is a row of columns {', '.join(map(repr, list(item)[:6]))}; say which are the "
                f'model\'s inputs and which its target: {DATA_COLUMNS} = {{"inputs": ["input_ids", ...], '
                f'"target": "labels"}} (or return example_inputs as a dict by the forward\'s parameter names)'
            )
        target_column = columns["target"]
        missing = [c for c in [*columns["inputs"], target_column] if c is not None and c not in item]
        if missing:
            raise DataError(f"{path}: {where} has no column {missing[0]!r} ({DATA_COLUMNS}); it has {', '.join(item)}")
        inputs = tuple(torch.as_tensor(item[c]) for c in columns["inputs"])
        return inputs, (() if target_column is None else torch.as_tensor(item[target_column]))
    try:
        inputs, target = item
    except (TypeError, ValueError):
        raise DataError(f"{path}: {where} is a {type(item).__name__}; expected (inputs, target)") from None
    return inputs, target


def recorded_model_file(workflow: Workflow, given: Path | None) -> Path:
    """The model file to read the data (and the adapter's base) from: `given` (--model), else the file
    workflow.yaml names, resolved from the current folder as the compiler was run, and refused (DataError)
    when it is not there or is not the file the build was compiled from (its sha256)."""
    if given is not None:
        return given
    path = Path(workflow.data.model_file)
    fix = "run cloudless-run from the folder cloudless-compile ran in, or pass --model PATH"
    if not path.is_file():
        raise DataError(f"{path}: the model file workflow.yaml names is not in {Path.cwd()}; {fix}")
    recorded = workflow.data.model_sha256
    found = hashlib.sha256(path.read_bytes()).hexdigest()
    if recorded is not None and found != recorded:
        raise DataError(
            f"{path}: not the model file the build was compiled from (sha256 {found[:12]}… here, {recorded[:12]}… "
            f"in workflow.yaml); {fix} (--model {path} trains on this one)"
        )
    return path


class StagedData(TypedDict):
    """What `stage_data` did: the samples of each split (for a missing test split, why it is missing),
    and per staged split the fingerprint of its content and whether it was staged, re-staged (the
    stored data differed, or was damaged: `reason` says how) or reused."""

    train: int
    test: int | str
    fingerprint: dict[str, str]
    action: dict[str, Staging]
    reason: dict[str, str]


def stage_data(
    channel: Channel,
    region: str,
    model_path: Path,
    *,
    force: bool = False,
    sources: Sequence[DataSource] = (),
    name: str | None = None,
    shard_samples: int | None = None,
    deployed: bool = False,
    granted: Sequence[str] = (),
) -> StagedData:
    """Make storage hold the region's train split (required) and test split (if load_shard gives
    one) as load_shard gives them now: storage is shared by runs, and the model file may have changed
    since it was staged. load_shard is always read and fingerprinted; what is stored is reused when
    its fingerprint matches (no writes), else re-staged (`write_split`); `force` rewrites it anyway.
    A stored test split that load_shard no longer gives is deleted, so no run is tested on it.
    `sources` (several regions, data moved) are the slices of other regions' train splits it trains
    on, kept under `name` (data.data_name). `deployed`: the functions run in a cloud, which reads shards
    where they lie in S3 only, and only those the build's roles may read (`granted`: the train split's
    locations as the compile saw them, workflow Region.data_in_place)."""
    module = load_model_module(model_path)
    # Recorded in meta as where the data came from; not part of the fingerprint: the data is shared
    # per region and split, and a model file whose load_shard gives the same samples (an edit of the
    # model, another copy of the file) must reuse it rather than re-stage it for every run.
    provenance = {"model_file": model_path.name, "model_sha256": hashlib.sha256(model_path.read_bytes()).hexdigest()}
    counts: dict[str, int | str] = {}
    fingerprints: dict[str, str] = {}
    actions: dict[str, Staging] = {}
    reasons: dict[str, str] = {}
    for split in ("train", "test"):
        where = name if name and split == "train" else region
        moved = split == "train" and bool(sources)  # slices of regions' data (several regions)
        # A region's own whole split is read as it is: shards where they lie never move (the planner moves no
        # data from or into their region), so their one source is the region's own data.
        own = moved and [s.region for s in sources] == [region] and sources[0].first == 0
        try:
            given = None if moved and not own else _load_shard(module, model_path, region, split)
            pattern = None if given is None else in_place_pattern(given, model_path.resolve().parent)
            sliced = moved and pattern is None
            if given is None and not sliced:
                raise DataError(
                    f"{model_path}: load_shard({region!r}, {split!r}) gives None; expected a dataset, or shards "
                    "where they lie (docs/data.md)"
                )
            if deployed and pattern is not None:
                first = pattern if isinstance(pattern, str) else pattern[0]
                if not first.startswith("s3://"):
                    raise DataError(
                        f"{model_path}: load_shard({region!r}, {split!r}) gives shards in a folder of this machine "
                        f"({first}), which a deployed function cannot read; copy them to the region's S3 and give "
                        "s3://BUCKET/… locations"
                    )
                named = [given] if isinstance(given, str) else list(given or ())  # as given, not made absolute
                if split == "train" and named != list(granted):
                    raise DataError(
                        f"{model_path}: load_shard({region!r}, 'train') names {', '.join(named)}, but the build was "
                        f"compiled for {', '.join(granted) or 'staged data'}: its first stage's role may read only "
                        "that; compile the model file again"
                    )
            indexed = (
                None
                if pattern is None
                else index_in_place(channel, where, split, pattern, module, model_path, provenance)
            )
        except DataError as exc:
            if split == "train":
                raise
            remove_split(channel, where, split)  # a test split of other data would give wrong figures
            counts[split] = str(exc)  # no test split: the run trains but reports no test figures
            continue
        if indexed is not None:
            counts[split], fingerprints[split], actions[split] = indexed.samples, indexed.fingerprint, indexed.action
            reasons[split] = indexed.read
            continue
        if split == "train" and sources:
            samples = _samples(module, model_path, split, [(s.region, s.first, s.count) for s in sources])
        else:
            samples = _samples(module, model_path, split, [(region, 0, None)], dataset=given)
        try:
            written = write_split(channel, where, split, samples, shard_samples, force=force, provenance=provenance)
        except (DataError, ValueError) as exc:
            if split == "train":
                raise DataError(str(exc)) from exc
            remove_split(channel, where, split)  # a test split of other data would give wrong figures
            counts[split] = str(exc)  # no test split: the run trains but reports no test figures
            continue
        counts[split], fingerprints[split], actions[split] = written.samples, written.fingerprint, written.action
        if written.reason:
            reasons[split] = written.reason
    return StagedData(
        train=int(counts["train"]), test=counts["test"], fingerprint=fingerprints, action=actions, reason=reasons
    )


def index_in_place(
    channel: Channel,
    name: str,
    split: str,
    pattern: str | list[str],
    module: ModuleType,
    model_path: Path,
    provenance: Mapping[str, Any],
) -> WrittenSplit:
    """Make the split's `meta` the index of shards where they lie (`shards.index_split`): each shard's
    location, sample count, size and version, read from the shards' headers (or a wids index), never
    their samples (a Parquet file's footer); a stored index whose shards are unchanged is reused as it is. The
    functions read the shards themselves, through the model file's `transform` (required: a shard's samples
    are dicts of bytes, or a Parquet file's rows)."""
    if not callable(getattr(module, "transform", None)):
        named = pattern if isinstance(pattern, str) else pattern[0]
        raise DataError(
            f"{model_path}: load_shard gives shards where they lie ({named}), whose samples are dicts: of bytes by "
            "extension in tar shards ({'__key__': ..., 'jpg': b'...', 'cls': b'3'}), of a row's columns in Parquet "
            "files; define transform(sample, *, epoch, index) returning (inputs, target), as a dataset's item"
        )
    previous = read_meta(channel, name, split) or {}
    in_place = previous.get("format") in IN_PLACE_FORMATS
    known = [ShardEntry.from_json(e) for e in previous.get("shards", [])] if in_place else []

    if previous and not in_place:  # staged shards of earlier data: not read any more
        remove_split(channel, name, split)

    def write_members(entry: ShardEntry, members: Members) -> None:
        # before the meta that names the shard (a function reads the meta first)
        table = json.dumps(members, separators=(",", ":")).encode()
        channel.put(protocol.members_key(name, split, entry.location, entry.version), table)

    try:
        index = index_split(pattern, known, scanned=write_members)
    except (ShardError, ObjectError) as exc:
        raise DataError(f"{model_path}: the {split} split: {exc}") from None
    fingerprint = index.fingerprint
    meta = {
        "format": index.format,
        "shards": [entry.to_json() for entry in index.entries],
        "samples": index.samples,
        "fingerprint": fingerprint,
        "shuffle_shards": SHUFFLE_SHARDS,
        "staged_from": dict(provenance),
    }
    read = f"{len(index.entries)} shard(s), {index.reads.requests} request(s), {index.reads.bytes:,} bytes read"
    if previous.get("fingerprint") == fingerprint and previous.get("shuffle_shards") == SHUFFLE_SHARDS:
        return WrittenSplit(index.samples, fingerprint, "reused", read=read)
    channel.put(data_key(name, split, DATA_META), json.dumps(meta, sort_keys=True).encode())
    # the member tables of shards no longer indexed (written again, or gone), after the meta that no longer names them
    kept = {(entry.location, entry.version) for entry in index.entries}
    for entry in sorted({(e.location, e.version) for e in known} - kept):
        channel.delete(protocol.members_key(name, split, *entry))
    return WrittenSplit(index.samples, fingerprint, "indexed", read=read)


def stage_run_weights(
    model: Path, regions: Sequence[Region], channels: Mapping[str, Channel], run_id: str
) -> str | None:
    """A staged build's weights into each region's storage for run `run_id` (staged_weights.py), from
    the model file's build_model(); the line saying so, or None for a build that holds its weights."""
    if not staged_functions(regions):
        return None
    targets = {region.name: (channels[region.name], protocol.namespace(run_id, region.name)) for region in regions}
    done = stage_weights(load_model_module(model), regions, targets)
    return (
        f"weights: {done.functions} stages' parameters staged from build_model(), "
        f"{done.bytes / 2**20:.1f} MiB in {done.seconds:.1f} s"
    )


def changed_since_compile(region: Region, staged: StagedData) -> str | None:
    """A line saying the training data is not what the compile sized (the run's iterations and, with several
    regions, each region's share and weight came from the count then), or None."""
    if region.samples is None or staged["train"] == region.samples:
        return None
    return (
        f"warning: {region.name}'s train split holds {staged['train']:,} samples, where the compile counted "
        f"{region.samples:,}: the run trains the iterations planned for those; compile again to plan for these"
    )


def describe_staged(staged: StagedData) -> str:
    """One line for the run's banner: per split its samples, short fingerprint and what was done, so
    that a user sees when the data changed or was damaged (re-staged, and why) or which data a run
    trained on."""
    parts = []
    for split, samples in (("train", staged["train"]), ("test", staged["test"])):
        if isinstance(samples, str):
            reason = " ".join(samples.split())
            parts.append(f"no {split} split ({reason if len(reason) <= 100 else reason[:99] + '…'})")
            continue
        fingerprint = staged["fingerprint"][split]
        short = fingerprint[: len(FINGERPRINT_PREFIX) + 12]
        why = staged["reason"].get(split)
        parts.append(f"{split} {samples} samples ({short}, {staged['action'][split]}{f': {why}' if why else ''})")
    return "data: " + ", ".join(parts)


def load_stages(build: Path, workflow: Workflow, region: str) -> tuple[list[Any], torch.nn.Module]:
    """The region's stage modules, in order, and its loss module (as the packages hold them)."""
    functions = workflow.region(region).functions  # in stage order
    model_file = workflow.data.model_file
    stages = [load_stage_module(build / f.package, f"cloudless_eval_{f.stage}", model_file) for f in functions]
    loss = load_module(build / functions[-1].package / f"{workflow.data.loss}.py", "cloudless_eval_loss")
    return stages, loss.Stage()


def trained_state(channel: Channel, namespace: str, stages: int, iteration: int) -> dict[str, torch.Tensor]:
    """The whole model's parameters and buffers after `iteration` iterations (original names)."""
    state: dict[str, torch.Tensor] = {}
    for s in range(stages):
        values = unpack(channel.get(protocol.state_key(namespace, s, iteration), timeout=60))
        state.update(protocol.module_values(values))
    return state


def newer_global_version(channel: Channel, namespace: str, stage: int, version: int) -> dict[str, torch.Tensor] | None:
    """ASGD-GA: the stage's newest global version after `version` in the server's storage (`channel`,
    `namespace`: the server region's), one written by a region that left after pushing it, which no
    region that stayed holds; None if none (a version claimed but voided, `LEFT_MARK`, does not count)."""
    newest = None
    version += 1
    while channel.try_get(protocol.global_key(namespace, stage, version, "owner")) is not None:
        data = channel.try_get(protocol.global_key(namespace, stage, version, "model"))
        if data is not None and data != protocol.LEFT_MARK:
            newest = data
        version += 1
    return unpack(newest) if newest is not None else None


def frozen_weights(build: Path, region: Region, channel: Channel, namespace: str) -> dict[str, torch.Tensor]:
    """The region's frozen parameters (`Function.frozen_parameters`) as its packages (or, for a staged
    build, the run's staged weights in `channel`, `namespace`) hold them: never trained, so in no
    checkpoint."""
    frozen: dict[str, torch.Tensor] = {}
    for function in region.functions:
        if function.frozen_parameters:
            initial = package_weights(build / function.package, function, channel, namespace, 60)
            frozen.update({name: initial[name] for name in function.frozen_parameters})
    return frozen


def model_file_state(build: Path, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The trained tensors keyed like the user model's state_dict, so that `load_state_dict(...,
    strict=True)` takes them: a tied weight under each of its names, non-persistent buffers left out.
    Also the keys no stage holds (tensors forward never uses: not trained, not in the file)."""
    names = state_names(build)
    if not names:  # a build without the graph, or from before it recorded them: the stages' names
        return {k: v.contiguous() for k, v in sorted(state.items())}, []
    # clones: safetensors refuses two names for one memory
    keyed = {key: state[source].clone().contiguous() for key, source in sorted(names.items()) if source in state}
    return keyed, sorted(key for key, source in names.items() if source not in state)


def untouched_tensors(model_path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The state `names` of the model file's model as build_model() builds it: tensors no stage
    holds (the forward never uses them, so training never changes them; a peft `modules_to_save`
    keeps such an original copy), for a model.safetensors that loads strictly."""
    state = load_model_module(model_path).build_model().state_dict()
    return {name: state[name].detach().clone().contiguous() for name in names}


def save_peft_adapter(model_path: Path, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Save the trained adapter of the model file's peft model as peft saves one
    (`adapter_model.safetensors`, `adapter_config.json`: `PeftModel.from_pretrained` loads it). The
    model is built on the meta device, so the base model's weights are never allocated; the trained
    tensors replace its parameters, every adapter parameter must be among them."""
    module = load_model_module(model_path)
    with torch.device("meta"):
        model = module.build_model()
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    untrained = [name for name, parameter in model.named_parameters() if name in missing and parameter.requires_grad]
    if untrained:
        raise DataError(f"{model_path}: the run trained no value for the adapter's {', '.join(untrained[:3])}")
    model.save_pretrained(str(folder))


def _test_batches(
    build: Path, workflow: Workflow, region: str, channel: Channel, size: int
) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The test split in whole micro-batches of `size`, in its order, as (flat inputs, flat targets): staged
    shards as they are, or shards where they lie through the model file's transform and collate_fn, as the
    package holds it (epoch 0, the generators seeded per sample as in training)."""
    meta = read_meta(channel, region, "test") or {}
    package = build / workflow.region(region).functions[0].package
    batches = open_batches(
        channel,
        meta,
        region,
        "test",
        lambda: user_module(package, workflow.data.model_file),
        seed=workflow.run.seed,
        micro_batch=size,
        global_batch=size,
        timeout=60.0,
    )
    yield from batches.in_order(size)


@torch.no_grad()
def evaluate(
    build: Path, workflow: Workflow, region: str, channel: Channel, state: dict[str, torch.Tensor]
) -> dict[str, Any] | None:
    """Mean loss on the region's test split, and accuracy when the model's one output is class
    scores (batch x classes) for one integer target; None without a test split. It runs the stages
    chained in whole micro-batches, the shapes the stages were generated for."""
    if channel.try_get(data_key(region, "test", DATA_META)) is None:
        return None
    modules, loss_module = load_stages(build, workflow, region)
    stages = []
    for module in modules:
        stage = module.Stage()
        own = set(stage.state_dict())
        stage.load_state_dict({k: v for k, v in state.items() if k in own}, strict=True)
        stages.append((stage.eval(), list(module.INPUTS), list(module.OUTPUTS)))
    size = workflow.run.micro_batch
    total_loss, correct, counted, batches = 0.0, 0, 0, 0
    for inputs, targets in _test_batches(build, workflow, region, channel, size):
        values = dict(zip(workflow.data.inputs, inputs, strict=True))
        outputs: tuple[Any, ...] = ()
        with autocast(workflow.run.precision):  # the precision the model trained in
            for stage, stage_inputs, names in stages:
                outputs = tuple(stage(*[values[n] for n in stage_inputs]))
                values.update(zip(names, outputs, strict=True))
            (loss,) = loss_module(*outputs, *targets)
        total_loss += float(loss)
        batches += 1
        if len(outputs) == 1 and len(targets) == 1 and outputs[0].dim() == 2 and not targets[0].is_floating_point():
            correct += int((outputs[0].argmax(dim=1) == targets[0]).sum())
            counted += size
    if batches == 0:
        return None
    result: dict[str, Any] = {"samples": batches * size, "loss": total_loss / batches}
    if counted:
        result["accuracy"] = correct / counted
    return result
