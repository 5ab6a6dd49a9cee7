"""The training plan: the chosen pipeline, its predicted figures, the baselines, and (several regions)
the schedule between regions.

Typed, frozen objects; `TrainingPlan.to_json()` is the content of `plan.json` and
`TrainingPlan.from_json()` reads it back. Each class's fields are the keys of its JSON object, in the
order the file has always been written (a field's `json` metadata names a key that is not a Python
identifier, such as `from`); the conversion both ways follows the fields' type hints, so a key is
spelled once, here, and `ir/schemas/plan.schema.json` is checked against these fields by the tests.
Standard library only.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, is_dataclass
from typing import Any, Literal, TypeVar

from .workflow import API_VERSION, InterRegionSync, Schedule

PLAN_KIND = "Plan"

Objective = Literal["cost", "time", "cost-under-deadline", "time-under-budget"]
SolverStatus = Literal["optimal", "feasible"]
#: the families of plans the chosen plan is compared with (compiler/planner/explain.py)
AlternativeFamily = Literal[
    "pipeline",
    "data-parallel",
    "fewer-stages",
    "fewer-replicas",
    "more-replicas",
    "smaller-tier",
    "larger-tier",
    "micro-batch",
]

_T = TypeVar("_T", bound="_Document")


def json_key(item: Field[Any]) -> str:
    """The JSON key of a dataclass field: its `json` metadata, else its name."""
    return str(item.metadata.get("json", item.name))


class _Document:
    """A frozen dataclass whose JSON form is one object with a key per field.

    A field whose metadata has `omit_none` is left out of the object when it is None (and None when
    its key is absent)."""

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {}
        for item in fields(self):  # type: ignore[arg-type]  # every subclass is a dataclass
            value = getattr(self, item.name)
            if value is None and item.metadata.get("omit_none"):
                continue
            document[json_key(item)] = _encode(value)
        return document

    @classmethod
    def from_json(cls: type[_T], data: Mapping[str, Any]) -> _T:
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for item in fields(cls):  # type: ignore[arg-type]
            key = json_key(item)
            if key in data:
                values[item.name] = _decode(hints[item.name], data[key], key)
            elif not item.metadata.get("omit_none"):
                raise ValueError(f"{cls.__name__}: key {key!r} missing")
        return cls(**values)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The fields' types (resolved once per class: the annotations are strings here)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _encode(value: Any) -> Any:
    if isinstance(value, _Document):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _decode(hint: Any, value: Any, where: str) -> Any:
    """`value` of a document that passed its schema, as the type `hint` says."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value, where)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, where) for v in value)
        return tuple(_decode(a, v, where) for a, v in zip(args, value, strict=True))
    if origin in (dict, Mapping):
        return {str(k): _decode(args[1], v, where) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, _Document):
        return hint.from_json(value)
    if hint is int:
        return int(value)
    # float (an int in the file stays an int, so that the file reads back to the same bytes), str,
    # bool and Literal values are taken as they are: the schema has checked them.
    if origin is Literal or hint in (float, str, bool):
        return value
    raise TypeError(f"plan key {where!r}: no conversion for {hint!r}")


@dataclass(frozen=True)
class PlannedStage(_Document):
    """One pipeline stage: the blocks and modules it computes, its function's tier and replicas, and
    its figures per micro-batch (compute) and per iteration (sync, update)."""

    index: int
    #: first and last block of the chain
    blocks: tuple[int, int]
    #: the model's modules the blocks hold, in order, each once
    modules: tuple[str, ...]
    tier_mb: int
    replicas: int
    #: memory the stage needs of its function, MB
    memory_mb: float
    forward_s: float
    backward_s: float
    sync_s: float
    update_s: float


@dataclass(frozen=True)
class Totals(_Document):
    """A plan's time and cost over several iterations (a run, an epoch)."""

    iterations: int
    time_s: float
    cost_usd: float


@dataclass(frozen=True)
class Figures(_Document):
    """What the cost model predicts for one iteration of a plan (and the simulator's iteration time)."""

    iteration_s: float
    simulated_iteration_s: float
    cost_usd: float
    pipeline_s: float
    sync_s: float
    update_s: float
    compute_usd: float
    request_usd: float
    storage_usd: float
    per_run: Totals
    #: None when the model file does not say how much training data there is
    per_epoch: Totals | None
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class SolverReport(_Document):
    name: str
    status: SolverStatus
    #: relative optimality gap; None when the solver proved no bound
    gap: float | None
    #: per micro-batch size (the solve time itself is printed, not written: builds are reproducible)
    time_limit_s: float
    #: micro-batch size (as a string: a JSON key) -> what the solve of that size ended with
    candidates: Mapping[str, str]


@dataclass(frozen=True)
class BaselinePlan(_Document):
    """A baseline's plan on the same cost model, or why it has none."""

    name: str
    description: str
    feasible: bool
    #: why it is infeasible ("" when feasible)
    reason: str
    micro_batch: int | None
    stages: tuple[PlannedStage, ...]
    predicted: Figures | None
    #: the chosen plan's time and cost over the baseline's (None when infeasible)
    time_ratio: float | None
    cost_ratio: float | None


@dataclass(frozen=True)
class FrontierPoint(_Document):
    """One of a region's pipeline plans the inter-region schedule chose among."""

    iteration_s: float
    cost_usd: float


@dataclass(frozen=True)
class SiteSchedule(_Document):
    """One region's part of the inter-region schedule."""

    name: str
    #: training samples the region holds
    data_samples: int
    trains: bool
    #: samples it trains on and iterations it runs (fractional: the schedule's continuous answer)
    samples: float
    iterations: float
    #: the whole iterations workflow.yaml runs there (None: it does not train)
    runs_iterations: int | None
    #: its pipeline plan (empty when it does not train)
    stages: tuple[PlannedStage, ...]
    iteration_s: float | None
    move_in_s: float
    work_s: float
    sync_s: float
    cost_usd: float
    frontier: tuple[FrontierPoint, ...]


@dataclass(frozen=True)
class DataMove(_Document):
    """Training samples moved from one region to another before training."""

    from_region: str = field(metadata={"json": "from"})
    to_region: str = field(metadata={"json": "to"})
    samples: float


@dataclass(frozen=True)
class RegionsSolverReport(_Document):
    status: SolverStatus
    gap: float | None


@dataclass(frozen=True)
class RegionsBaseline(_Document):
    """A restricted inter-region schedule (data kept local, or all data in one region)."""

    name: str
    description: str
    feasible: bool
    reason: str
    training_s: float | None
    cost_usd: float | None
    #: the chosen schedule's training time and cost over the baseline's
    time_ratio: float | None
    cost_ratio: float | None


@dataclass(frozen=True)
class RegionSchedule(_Document):
    """Several regions: the schedule between them (the compiler's geo level)."""

    sync: InterRegionSync
    sync_every: int
    rounds: int
    #: ASGD-GA's parameter-server region (None under model averaging)
    server: str | None
    training_s: float
    cost_usd: float
    solver: RegionsSolverReport
    sites: tuple[SiteSchedule, ...]
    moves: tuple[DataMove, ...]
    baselines: tuple[RegionsBaseline, ...]


@dataclass(frozen=True)
class AlternativeStage(_Document):
    """One stage of an alternative plan."""

    blocks: tuple[int, int]
    tier_mb: int
    replicas: int


@dataclass(frozen=True)
class PlanTerm(_Document):
    """One term of an iteration's time or cost (compiler/planner/explain.py), in an alternative and in the
    chosen plan."""

    name: str
    alternative: float
    chosen: float


@dataclass(frozen=True)
class Alternative(_Document):
    """Why the plan won: the best plan of a family the chosen plan is not in, on the same cost model, and
    the term it loses by (compiler/planner/explain.py)."""

    family: AlternativeFamily
    label: str
    #: which plans the family holds
    description: str
    #: the family's best plan within the limits (null and empty when it has none)
    micro_batch: int | None
    #: whether it is the family's best, proven within 0.01 % (false: the best the solver found in its time limit)
    proven: bool
    stages: tuple[AlternativeStage, ...]
    iteration_s: float | None
    cost_usd: float | None
    #: the alternative's time and cost over the chosen plan's: above 1, the alternative is worse
    time_factor: float | None
    cost_factor: float | None
    #: what `terms` measure per iteration: the objective's seconds or dollars (the other when the two tie)
    unit: Literal["s", "USD"]
    terms: tuple[PlanTerm, ...]
    #: the term the alternative loses most by, and the term it gains most by ("": none)
    loses_by: str
    gains_by: str
    #: why it lost, or why the family has no plan, in words
    summary: str


@dataclass(frozen=True)
class TrainingPlan(_Document):
    """plan.json. With several regions, the fields outside `regions` are the plan of the region whose
    partition every region shares."""

    model: str
    region: str
    objective: Objective
    schedule: Schedule
    deadline_s: float | None
    budget_usd: float | None
    global_batch: int
    micro_batch: int
    micro_batches: int
    stages: tuple[PlannedStage, ...]
    predicted: Figures
    solver: SolverReport
    baselines: tuple[BaselinePlan, ...]
    regions: RegionSchedule | None = field(default=None, metadata={"omit_none": True})
    #: why the chosen plan won, against the best plan of each other family (absent across several regions)
    explanation: tuple[Alternative, ...] | None = field(default=None, metadata={"omit_none": True})

    def to_json(self) -> dict[str, Any]:
        return {"apiVersion": API_VERSION, "kind": PLAN_KIND, **super().to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrainingPlan:
        """The plan of a document that passed its schema (`cloudless.ir.files.load_plan` checks it)."""
        if data.get("apiVersion") != API_VERSION or data.get("kind") != PLAN_KIND:
            raise ValueError(
                f"not a {API_VERSION} {PLAN_KIND}: apiVersion {data.get('apiVersion')!r}, kind {data.get('kind')!r}"
            )
        return super().from_json(data)


#: keys of plan.json that are no field of TrainingPlan: the document's version and kind
HEADER_KEYS = ("apiVersion", "kind")


def document_classes() -> tuple[type, ...]:
    """Every class of the plan's JSON form (for the tests that hold them to the schema)."""
    found: list[type] = []

    def visit(hint: Any) -> None:
        if isinstance(hint, type) and is_dataclass(hint) and issubclass(hint, _Document):
            if hint not in found:
                found.append(hint)
                for inner in _hints(hint).values():
                    visit(inner)
        for arg in typing.get_args(hint):
            visit(arg)

    visit(TrainingPlan)
    return tuple(found)
