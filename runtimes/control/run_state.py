"""What a run is told and what it records: its settings, each region's plan from the coordinator, each
region's record (progress, results, faults), and how a run fails."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...ir import protocol
from ...ir.protocol import InvocationResult
from .elastic import CapacityChange, RegionFailure


class RunError(RuntimeError):
    """The run cannot go on (an invocation failed more often than allowed, or bad settings). `resumable`:
    whether `--resume` may continue it from its checkpoints (not when the model's own code raised)."""

    def __init__(self, message: str, resumable: bool = True) -> None:
        super().__init__(message)
        self.resumable = resumable


class RunDiverged(RunError):
    """A loss or a parameter stopped being finite; the message names the iteration and the stage."""

    def __init__(self, message: str) -> None:
        super().__init__(message, resumable=False)


class RegionGone(RunError):
    """Several regions: this region leaves the run (its invocations failed beyond their retries, the
    others went on without it, it stopped answering, or its capacity no longer holds its pipeline);
    the others go on. `tell`: the coordinator writes its departure (`protocol.left_key`) so that no
    meet waits for it."""

    def __init__(self, message: str, tell: bool) -> None:
        super().__init__(message)
        self.tell = tell


@dataclass
class Progress:
    """One finished iteration as the last stage reported it."""

    iteration: int
    loss: float
    time: float
    region: str = ""


@dataclass
class RunSettings:
    iterations: int
    run_id: str
    time_limit_s: float | None = None  # a worker's time limit per invocation (default: its timeout)
    key_timeout_s: float = protocol.DEFAULT_KEY_TIMEOUT_S
    retries: int = 3
    fault_rate: float = 0.0
    fault_seed: int = 0
    poll_s: float = 0.05
    resume: bool = False  # continue run_id from its stages' newest common checkpoint
    alive_check_s: float = 2.0  # how often the controller checks that storage still holds the run
    # several regions: how long a meet waits for a region before going on without it
    region_timeout_s: float = protocol.DEFAULT_REGION_TIMEOUT_S
    capacity_changes: tuple[CapacityChange, ...] = ()
    region_failures: tuple[RegionFailure, ...] = ()  # injected: a region stops answering


@dataclass
class RegionPlan:
    """The coordinator's plan of one region: it trains until iteration `end`; since iteration `since`
    its iterations hold rounds `first_round`..`rounds`-1 (`workflow.round_meets`; `rounds`: the run's
    rounds under this plan, more than planned once a re-plan gave the run new rounds; None with one
    region); its replicas per stage and weight (share of the samples; None: the workflow's). `next`: a
    re-plan taking effect where its range under way stops (at the coordinator's stop request, or
    earlier at a time limit). `left`: why it left ("" while it trains)."""

    end: int
    replicas: tuple[int, ...]
    weight: float | None = None
    rounds: int | None = None
    since: int = 0
    first_round: int = 0
    next: RegionPlan | None = None
    left: str = ""
    met: tuple[int, ...] = ()  # the meets of its earlier plans (up to `since`)


@dataclass
class RegionRun:
    """What happened: progress per iteration, every invocation's result, the faults injected."""

    progress: list[Progress] = field(default_factory=list)
    results: list[InvocationResult] = field(default_factory=list)
    invocations: list[dict[str, Any]] = field(default_factory=list)
    faults: int = 0
    retries: int = 0
    lost_reports: int = 0


@dataclass
class RunMetrics:
    """OUT/metrics.json, whichever way the run went (cloudless-run on this machine, or the deploy-and-train
    driver on a stack): who ran it, how it ended and in how long, per region what happened, and the
    figures the invoker measured (the local run's losses, throughput, storage requests and cost; the
    driver's executions)."""

    run_id: str
    invoker: str  # as --invoker named it: "local", "openfaas", "lambda" (with --stack: the driver)
    status: str  # "done", "failed", or "interrupted" (Ctrl-C, SIGTERM: the keys stay for --resume)
    seconds: float
    error: str | None = None
    regions: dict[str, dict[str, Any]] = field(default_factory=dict)  # several regions, or a stack's
    measured: dict[str, Any] = field(default_factory=dict)  # the invoker's own figures, as top-level keys

    def to_json(self) -> dict[str, Any]:
        document = dict(self.measured)
        document.update(run_id=self.run_id, invoker=self.invoker, status=self.status, seconds=round(self.seconds, 3))
        if self.error is not None:
            document["error"] = self.error
        if self.regions:
            document["regions"] = self.regions
        return document

    def write(self, out: Path) -> None:
        # allow_nan=False: the file is JSON for any reader (a non-finite figure is null, never NaN)
        text = json.dumps(self.to_json(), indent=1, sort_keys=True, allow_nan=False) + "\n"
        (out / "metrics.json").write_text(text)
