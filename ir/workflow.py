"""The workflow: regions, functions, storage, and the DAG of one training iteration's steps.

Typed, frozen objects; `Workflow.to_json()` is the content of `workflow.yaml` (and of every
`function.json`), keys in a fixed order, and `Workflow.from_json()` reads it back. This module
imports the standard library only: it is vendored into every function package, whose worker reads
its workflow through it. The file forms (YAML, the JSON Schema and the DAG check) are in
`cloudless.ir.files`, which the packages do not need.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

API_VERSION = "cloudless/v1"

Schedule = Literal["gpipe", "1f1b"]
#: TRAINING["precision"]: "32-true" trains in float32; "bf16-mixed" runs forward and loss under CPU
#: autocast to bfloat16 (float32 weights and optimizer state) and sends activations and their
#: gradients between stages as bfloat16
Precision = Literal["32-true", "bf16-mixed"]
PRECISIONS: tuple[Precision, ...] = ("32-true", "bf16-mixed")
StepKind = Literal[
    "compute", "scatter-reduce", "cross-region-reduce", "optimizer-step", "checkpoint", "asgd-ga-push", "model-average"
]
#: sync: every iteration's gradients meet across regions (synchronous SGD); asgd-ga: each region adds
#: its round's update to the global model (bounded staleness); model-average: regions meet each round
InterRegionSync = Literal["sync", "asgd-ga", "model-average"]

#: step kinds of one iteration, in the order a stage's function runs them
STEP_KINDS: tuple[StepKind, ...] = (
    "compute",
    "scatter-reduce",
    "cross-region-reduce",
    "optimizer-step",
    "asgd-ga-push",
    "model-average",
    "checkpoint",
)
#: the step kind that syncs a stage with its counterparts in other regions, per strategy
SYNC_STEP_KIND: dict[str, StepKind] = {
    "sync": "cross-region-reduce",
    "asgd-ga": "asgd-ga-push",
    "model-average": "model-average",
}


def round_ends(iterations: int, rounds: int) -> tuple[int, ...]:
    """After how many of its `iterations` a region's `rounds` inter-region syncs happen: round k
    (0-based) ends after ((k + 1) * iterations) // rounds iterations, the last after all of them.
    The planner keeps iterations >= rounds, so every round holds at least one iteration."""
    if not 1 <= rounds <= iterations:
        raise ValueError(f"{rounds} rounds over {iterations} iterations: expected 1 <= rounds <= iterations")
    return tuple(((k + 1) * iterations) // rounds for k in range(rounds))


def round_meets(end: int, rounds: int, *, since: int = 0, first_round: int = 0) -> dict[int, int]:
    """A region's meet points: iterations done -> the index of the round that ends there. Its plan
    since iteration `since` (0, or where the coordinator last re-planned it) spreads its iterations
    since..end-1 over rounds `first_round`..rounds-1 as `round_ends` spreads a whole run."""
    ends = round_ends(end - since, rounds - first_round)
    return {since + e: first_round + k for k, e in enumerate(ends)}


def whole_iterations(shares: list[float], total: int, least: int) -> list[int]:
    """Whole numbers adding up to `total`, each at least `least`, near `shares` (which add up to
    `total`): the floors, then one more to the largest remainders; a share below `least` is raised
    to it, taken from the largest."""
    counts = [max(least, math.floor(x)) for x in shares]
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - math.floor(shares[i])), i))
    for i in order:
        if sum(counts) >= total:
            break
        counts[i] += 1
    while sum(counts) > total:
        above = [j for j in range(len(counts)) if counts[j] > least]
        if not above:
            break
        counts[max(above, key=lambda j: (counts[j] - shares[j], counts[j], -j))] -= 1
    return counts


@dataclass(frozen=True)
class RegionPrices:
    """A region's prices (the catalog's, same names and units), for the run's measured cost."""

    gb_second: float
    per_million_requests: float
    storage_put_per_1000: float
    storage_get_per_1000: float
    egress_per_gb: float

    def to_json(self) -> dict[str, Any]:
        return {
            "gb_second": self.gb_second,
            "per_million_requests": self.per_million_requests,
            "storage_put_per_1000": self.storage_put_per_1000,
            "storage_get_per_1000": self.storage_get_per_1000,
            "egress_per_gb": self.egress_per_gb,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RegionPrices:
        return cls(*(float(data[k]) for k in cls.__dataclass_fields__))


@dataclass(frozen=True)
class Function:
    """One pipeline stage's function in a region; its replicas are instances of it."""

    name: str
    stage: int
    #: first and last block of the chain the stage computes
    blocks: tuple[int, int]
    #: the function's configured memory (its tier), MB
    memory_mb: int
    #: the CPU share the platform gives that memory, thousandths of a vCPU
    cpu_millis: int
    #: MB/s each way to storage (the catalog's figure for the tier; what --emulate uses)
    network_mb_per_s: float
    replicas: int
    timeout_s: int
    #: folder of the function package, relative to the build
    package: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    #: parameters other stages also hold; their gradients are summed
    shared_parameters: tuple[str, ...]
    #: parameters the model froze (requires_grad=False as build_model() returns them): never trained,
    #: synced or checkpointed; they stay as the package's weights hold them
    frozen_parameters: tuple[str, ...] = ()
    #: parameters whose weights are not in the package (a model beyond the build's weight threshold):
    #: (the stage's tensor name, the model's parameter name); the run stages them into storage from
    #: the model file's build_model() and the function loads them from there (`protocol.weights_key`)
    staged_parameters: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, Any]:
        frozen: dict[str, Any] = {"frozen_parameters": list(self.frozen_parameters)} if self.frozen_parameters else {}
        if self.staged_parameters:
            frozen["staged_parameters"] = dict(self.staged_parameters)
        return {
            "name": self.name,
            "stage": self.stage,
            "blocks": list(self.blocks),
            "memory_mb": self.memory_mb,
            "cpu_millis": self.cpu_millis,
            "network_mb_per_s": self.network_mb_per_s,
            "replicas": self.replicas,
            "timeout_s": self.timeout_s,
            "package": self.package,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "shared_parameters": list(self.shared_parameters),
            **frozen,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Function:
        first, last = data["blocks"]
        return cls(
            name=data["name"],
            stage=int(data["stage"]),
            blocks=(int(first), int(last)),
            memory_mb=int(data["memory_mb"]),
            cpu_millis=int(data["cpu_millis"]),
            network_mb_per_s=float(data["network_mb_per_s"]),
            replicas=int(data["replicas"]),
            timeout_s=int(data["timeout_s"]),
            package=data["package"],
            inputs=tuple(data["inputs"]),
            outputs=tuple(data["outputs"]),
            shared_parameters=tuple(data["shared_parameters"]),
            frozen_parameters=tuple(data.get("frozen_parameters", ())),
            staged_parameters=tuple(sorted(dict(data.get("staged_parameters", {})).items())),
        )


@dataclass(frozen=True)
class DataSource:
    """A slice of `load_shard(region, "train")` that a region trains on."""

    region: str
    first: int
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"region": self.region, "first": self.first, "count": self.count}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DataSource:
        return cls(data["region"], int(data["first"]), int(data["count"]))


@dataclass(frozen=True)
class Region:
    """A region that trains: its functions (one per stage, in stage order) and its share of the run."""

    name: str
    provider: str
    #: training samples it holds (None: not known at compile time)
    samples: int | None
    #: one storage request's round trip, seconds
    request_latency_s: float
    functions: tuple[Function, ...]
    #: iterations this region trains
    iterations: int | None = None
    #: several regions: its share of the samples (model averaging's weight; under sync its share of a
    #: batch); its rounds end at round_ends(iterations, sync.rounds)
    weight: float | None = None
    #: what it trains on (several regions, or data moved to it); empty: its own load_shard
    data_sources: tuple[DataSource, ...] = ()
    #: where its train split lies in place, as load_shard named it at compile time (shard patterns, `s3://…`
    #: or a folder): what a deployed first stage's role may read; empty: staged data
    data_in_place: tuple[str, ...] = ()
    #: its prices, for the measured cost of a run (None: not written)
    prices: RegionPrices | None = None

    @property
    def stages(self) -> int:
        return len(self.functions)

    def function(self, name: str) -> Function:
        for function in self.functions:
            if function.name == name:
                return function
        raise KeyError(f"region {self.name} has no function {name!r}")

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "name": self.name,
            "provider": self.provider,
            "samples": self.samples,
            "request_latency_s": self.request_latency_s,
        }
        for key in ("iterations", "weight"):
            if getattr(self, key) is not None:
                document[key] = getattr(self, key)
        if self.data_sources:
            document["data_sources"] = [source.to_json() for source in self.data_sources]
        if self.data_in_place:
            document["data_in_place"] = list(self.data_in_place)
        if self.prices is not None:
            document["prices"] = self.prices.to_json()
        document["functions"] = [function.to_json() for function in self.functions]
        return document

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Region:
        functions = sorted((Function.from_json(f) for f in data["functions"]), key=lambda f: f.stage)
        return cls(
            name=data["name"],
            provider=data["provider"],
            samples=data["samples"],
            request_latency_s=float(data["request_latency_s"]),
            functions=tuple(functions),
            iterations=data.get("iterations"),
            weight=data.get("weight"),
            data_sources=tuple(DataSource.from_json(s) for s in data.get("data_sources") or ()),
            data_in_place=tuple(data.get("data_in_place") or ()),
            prices=RegionPrices.from_json(data["prices"]) if data.get("prices") else None,
        )


@dataclass(frozen=True)
class RunSettings:
    name: str
    iterations: int
    global_batch: int
    micro_batch: int
    micro_batches: int
    schedule: Schedule
    checkpoint_every: int
    seed: int
    #: TRAINING["max_grad_norm"]: every iteration's gradients are clipped to this global norm, over
    #: every trained parameter of every stage, as torch.nn.utils.clip_grad_norm_ clips a whole model's
    max_grad_norm: float | None = None
    precision: Precision = "32-true"

    def to_json(self) -> dict[str, Any]:
        # each emitted only when set: builds without them stay byte for byte as they were
        clip = {"max_grad_norm": self.max_grad_norm} if self.max_grad_norm is not None else {}
        mixed = {"precision": self.precision} if self.precision != "32-true" else {}
        return {
            "name": self.name,
            "iterations": self.iterations,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "checkpoint_every": self.checkpoint_every,
            "seed": self.seed,
            **clip,
            **mixed,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunSettings:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


def _rates(data: Any) -> tuple[float, ...] | None:
    return tuple(float(r) for r in data) if data is not None else None


def _stretched(rates: tuple[float, ...] | None, iteration: int, iterations: int) -> float | None:
    """The rate at `iteration` of a region that trains `iterations` in this run: the schedule
    stretched over them (every region of several walks the whole schedule over its own share, as a
    run with other iterations than planned does); None without a schedule."""
    if not rates:
        return None
    return rates[min(len(rates) - 1, iteration * len(rates) // max(1, iterations))]


@dataclass(frozen=True)
class ParameterGroup:
    """One of make_optimizer's parameter groups: its parameters (by the model's names), the options it
    sets beside the constructor's, and with a schedule its rate at each of the run's iterations."""

    parameters: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    learning_rates: tuple[float, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {"parameters": list(self.parameters), "options": dict(self.options)}
        if self.learning_rates is not None:
            document["learning_rates"] = list(self.learning_rates)
        return document

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ParameterGroup:
        return cls(tuple(data["parameters"]), dict(data["options"]), _rates(data.get("learning_rates")))


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and its constructor's keyword arguments; with a learning-rate schedule, the rate
    of each of the run's iterations (`learning_rate`). With several parameter groups, `groups` holds each
    one's parameters, options and rates (and `learning_rates` is None). The class is torch.optim's
    (`module` None), or a torch.optim.Optimizer subclass by its qualified name in `module`: an installed
    package's, a module's beside the model file, or the model file's own (`protocol.user_module_name`)."""

    class_name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    learning_rates: tuple[float, ...] | None = None
    groups: tuple[ParameterGroup, ...] = ()
    module: str | None = None

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {"class": self.class_name, "options": dict(self.options)}
        if self.module is not None:
            document["module"] = self.module
        if self.learning_rates is not None:
            document["learning_rates"] = list(self.learning_rates)
        if self.groups:
            document["groups"] = [group.to_json() for group in self.groups]
        return document

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OptimizerSpec:
        groups = tuple(ParameterGroup.from_json(g) for g in data.get("groups", ()))
        rates = _rates(data.get("learning_rates"))
        return cls(data["class"], dict(data["options"]), rates, groups, data.get("module"))

    def optimizer_class(self) -> Any:
        """The class, imported: torch.optim's, or `module`'s (the model file, when it is the module, must be
        imported before: its name is registered then). ImportError or AttributeError when it is not there."""
        value: Any = importlib.import_module(self.module or "torch.optim")
        for part in self.class_name.split("."):
            value = getattr(value, part)
        return value

    def learning_rate(self, iteration: int, iterations: int, group: int = 0) -> float | None:
        """The rate of parameter group `group` at `iteration` of a region that trains `iterations` in this
        run (`_stretched`); None without a schedule."""
        rates = self.groups[group].learning_rates if self.groups else self.learning_rates
        return _stretched(rates, iteration, iterations)


@dataclass(frozen=True)
class SyncSettings:
    """How models meet: inside a region (scatter-reduce in pieces) and between regions."""

    intra_region: Literal["pipelined-scatter-reduce", "sequential-scatter-reduce"]
    piece_bytes: int
    max_pieces: int
    inter_region: InterRegionSync | None = None
    #: several regions: syncs over the training, and ASGD-GA's server region
    rounds: int | None = None
    server: str | None = None
    #: asgd-ga: how many global versions a push's base may lag before the push is rebased
    staleness_bound: int | None = None

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "intra_region": self.intra_region,
            "piece_bytes": self.piece_bytes,
            "max_pieces": self.max_pieces,
            "inter_region": self.inter_region,
        }
        if self.inter_region is not None:
            document["rounds"] = self.rounds
            document["server"] = self.server
        if self.staleness_bound is not None:
            document["staleness_bound"] = self.staleness_bound
        return document

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SyncSettings:
        return cls(
            data["intra_region"],
            int(data["piece_bytes"]),
            int(data["max_pieces"]),
            data.get("inter_region"),
            data.get("rounds"),
            data.get("server"),
            data.get("staleness_bound"),
        )


@dataclass(frozen=True)
class StorageSpec:
    bucket: str
    prefix: str

    def to_json(self) -> dict[str, Any]:
        return {"bucket": self.bucket, "prefix": self.prefix}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StorageSpec:
        return cls(data["bucket"], data["prefix"])


@dataclass(frozen=True)
class DataSpec:
    #: the model file whose load_shard gives the data, as given to the compiler
    model_file: str
    #: the first stage's flat inputs
    inputs: tuple[str, ...]
    #: flat target tensors per micro-batch
    targets: int
    #: module, in the last stage's package, computing the loss
    loss: str
    #: "peft": build_model() returns a peft model, whose adapter the run also saves as peft does
    adapter: Literal["peft"] | None = None
    #: the model file's sha256 when it was compiled: a run finds that file, or says it found another
    model_sha256: str | None = None
    #: the stages run at the example inputs' shapes only (torch.export traced them: it keeps every size it saw);
    #: else only their micro-batch is fixed, and a collate_fn may pad each batch to its own longest
    fixed_shapes: bool = False

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "model_file": self.model_file,
            "inputs": list(self.inputs),
            "targets": self.targets,
            "loss": self.loss,
        }
        if self.adapter is not None:  # emitted only when there is one: builds without stay as they were
            data["adapter"] = self.adapter
        if self.model_sha256 is not None:
            data["model_sha256"] = self.model_sha256
        if self.fixed_shapes:
            data["fixed_shapes"] = True
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DataSpec:
        return cls(
            data["model_file"],
            tuple(data["inputs"]),
            int(data["targets"]),
            data["loss"],
            data.get("adapter"),
            data.get("model_sha256"),
            bool(data.get("fixed_shapes", False)),
        )


@dataclass(frozen=True)
class WanLink:
    """The link between two regions' storage."""

    between: tuple[str, str]
    mb_per_s: float
    latency_s: float

    def to_json(self) -> dict[str, Any]:
        return {"between": list(self.between), "mb_per_s": self.mb_per_s, "latency_s": self.latency_s}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WanLink:
        a, b = data["between"]
        return cls((a, b), float(data["mb_per_s"]), float(data["latency_s"]))


@dataclass(frozen=True)
class Step:
    """One node of an iteration's DAG: a kind of work of one function (all its replicas).

    Descriptive: nothing executes the steps. Each stage worker runs its function's steps itself, in
    a fixed order (compute, scatter-reduce when it has replicas, optimizer-step once its tied
    parameters' partner stages have their gradients, the inter-region sync, checkpoint) that is a
    topological order of `depends_on`; the controller only invokes ranges of iterations. A step
    with `every` runs after the iterations i with (i + 1) % every == 0; the inter-region sync step
    (`asgd-ga-push`, `model-average`) has none: it runs at the ends of the region's rounds,
    `round_ends(region.iterations, sync.rounds)` (`cross-region-reduce`: every iteration); a
    checkpoint is written by replica 0 (and also where an invocation stops). tests/test_protocol.py checks the worker's
    recorded order against these steps."""

    id: str
    kind: StepKind
    region: str
    function: str
    replicas: int
    depends_on: tuple[str, ...]
    #: runs on iterations that are multiples of this (None: every iteration)
    every: int | None = None

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "id": self.id,
            "kind": self.kind,
            "region": self.region,
            "function": self.function,
            "replicas": self.replicas,
            "depends_on": list(self.depends_on),
        }
        if self.every is not None:
            document["every"] = self.every
        return document

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Step:
        return cls(
            data["id"],
            data["kind"],
            data["region"],
            data["function"],
            int(data["replicas"]),
            tuple(data["depends_on"]),
            data.get("every"),
        )


@dataclass(frozen=True)
class Workflow:
    model: str
    run: RunSettings
    optimizer: OptimizerSpec
    sync: SyncSettings
    storage: StorageSpec
    data: DataSpec
    regions: tuple[Region, ...]
    steps: tuple[Step, ...]
    #: several regions: the links between their storage
    wan: tuple[WanLink, ...] | None = None

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise KeyError(f"workflow has no region {name!r}; it has {[r.name for r in self.regions]}")

    def functions(self) -> list[tuple[Region, Function]]:
        """Every (region, function) in region, then stage, order."""
        return [(region, function) for region in self.regions for function in region.functions]

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": "Workflow",
            "model": self.model,
            "run": self.run.to_json(),
            "optimizer": self.optimizer.to_json(),
            "sync": self.sync.to_json(),
            "storage": self.storage.to_json(),
            "data": self.data.to_json(),
            "regions": [region.to_json() for region in self.regions],
        }
        if self.wan is not None:
            document["wan"] = [link.to_json() for link in self.wan]
        document["steps"] = [step.to_json() for step in self.steps]
        return document

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Workflow:
        """The workflow of a document that passed its schema (`cloudless.ir.files.check_workflow`)."""
        if data.get("apiVersion") != API_VERSION or data.get("kind") != "Workflow":
            raise ValueError(f"not a {API_VERSION} Workflow: apiVersion {data.get('apiVersion')!r}")
        wan = data.get("wan")
        return cls(
            model=data["model"],
            run=RunSettings.from_json(data["run"]),
            optimizer=OptimizerSpec.from_json(data["optimizer"]),
            sync=SyncSettings.from_json(data["sync"]),
            storage=StorageSpec.from_json(data["storage"]),
            data=DataSpec.from_json(data["data"]),
            regions=tuple(Region.from_json(r) for r in data["regions"]),
            steps=tuple(Step.from_json(s) for s in data["steps"]),
            wan=None if wan is None else tuple(WanLink.from_json(link) for link in wan),
        )
