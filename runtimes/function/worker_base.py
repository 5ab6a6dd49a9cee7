"""What every part of a stage worker shares: the function's state, and the helpers each part uses.

A `StageWorker` (worker.py: an invocation, its iterations) is put together from one part per
responsibility, each a class over this base: checkpoints and resume (checkpoints.py), the pipeline's
forward and backward steps (pipeline_steps.py), the sync among a stage's replicas and tied partners
(replica_sync.py) and the sync between regions (region_sync.py). The state below is set by
`StageWorker.__init__` and, per invocation, by `StageWorker.run`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from ...ir.protocol import AbortRecord
from ...ir.workflow import Function, OptimizerSpec, Schedule, SyncSettings, Workflow
from ..storage.emulation import CpuShare, EmulatedChannel
from .data import SplitReader
from .failures import Aborted, Diverged, ModelFailed, one_line, where
from .function_channel import FunctionChannel
from .initial_weights import package_weights

_T = TypeVar("_T")


class WorkerBase:
    # -- the function, from its package ----------------------------------------------------------------
    package: Path
    workflow: Workflow
    region: str
    function: Function
    stage: int
    stages: int
    first: bool
    last: bool
    inputs: list[str]
    outputs: list[str]
    module: torch.nn.Module
    loss: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None  # None: the stage trains no parameter
    optimizer_groups: list[int]  # per torch parameter group, its index among the workflow's groups
    optimizer_spec: OptimizerSpec
    #: tied parameters of this stage -> the stages holding them
    holders: dict[str, list[int]]
    #: parameters the model froze: as the package's weights hold them, never trained, synced or checkpointed
    frozen: frozenset[str]
    # -- the run's settings ------------------------------------------------------------------------------
    seed: int
    global_batch: int
    micro_batch: int
    micro_batches: int
    schedule: Schedule
    checkpoint_every: int
    sync: SyncSettings
    pipelined_sync: bool
    data_name: str
    # -- storage ------------------------------------------------------------------------------------------
    link: EmulatedChannel  # every request of the function, counted (and emulated)
    channel: FunctionChannel
    cpu: CpuShare
    # -- this invocation (StageWorker.run) ----------------------------------------------------------------
    namespace: str  # keys of one run: "<run>/<region>"
    replica: int
    replicas: int
    window: int
    iterations: int
    # -- several regions (region_sync.py) -------------------------------------------------------------------
    inter_region: str | None
    planned: tuple[int | None, int | None]
    meets: dict[int, int]
    peers: list[tuple[str, float]]
    weight: float
    region_timeout: float | None
    key_timeout: float  # the invocation's: how long any wait for a key may take
    planned_replicas: list[int]
    departed: set[str]
    server: str | None
    wan: dict[str, EmulatedChannel]
    base_version: int
    # -- working state --------------------------------------------------------------------------------------
    _reader: SplitReader | None
    _batch: tuple[int, list[int]]
    _pool: ThreadPoolExecutor | None
    _reports: list[Future[None]]
    _link_threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None
    _ready: tuple[str, int, int] | None

    def initial_weights(self) -> dict[str, torch.Tensor]:
        """The stage's tensors as training starts: its package's weights and, for a staged build, the
        parameters the run put into storage (staged_weights.py)."""
        return package_weights(self.package, self.function, self.channel, self.namespace, self.key_timeout)

    def trained_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters the stage trains: not those the model froze (`Function.frozen_parameters`)."""
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.frozen]

    def _background(self) -> ThreadPoolExecutor:
        """Two threads for control requests off the critical path (reports, deletes, stop lookups)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="control")
        return self._pool

    @staticmethod
    def _span(spans: list[list[Any]], name: str) -> Span:
        return Span(spans, name)

    def _model_code(self, iteration: int, what: str, call: Callable[[], _T]) -> _T:
        """Run the model's own code (`what`: forward, loss, backward, optimizer step); what it raises
        becomes ModelFailed, naming the iteration, stage, function, replica and the exception."""
        try:
            with self.cpu.compute():
                return call()
        except (Aborted, Diverged):
            raise
        except Exception as exc:
            message = (
                f"iteration {iteration}: the {what} of stage {self.stage} ({self.function.name}, replica "
                f"{self.replica}) raised {type(exc).__name__}: {one_line(str(exc))}{where(exc)}"
            )
            raise ModelFailed(AbortRecord("failed", message, iteration, self.stage, self.function.name)) from exc

    def _check_finite(self, iteration: int, losses: list[float]) -> None:
        """Raise Diverged if a loss of this iteration, or a parameter after its step, is not finite."""
        bad = next((x for x in losses if not math.isfinite(x)), None)
        what = f"the loss is {bad}" if bad is not None else ""
        if not what and not all(bool(torch.isfinite(p).all()) for p in self.module.parameters()):
            what = "a parameter is not finite after the optimizer step"
        if what:
            message = (
                f"iteration {iteration}: {what} on stage {self.stage} ({self.function.name}, replica "
                f"{self.replica}): training diverged; lower the learning rate or check the data"
            )
            raise Diverged(AbortRecord("diverged", message, iteration, self.stage, self.function.name))


class Span:
    """Times a piece of work for the timeline: [name, wall-clock start, end] in seconds."""

    def __init__(self, spans: list[list[Any]], name: str) -> None:
        self.spans, self.name = spans, name

    def __enter__(self) -> None:
        self.began = time.time()

    def __exit__(self, *exc: object) -> None:
        self.spans.append([self.name, round(self.began, 6), round(time.time(), 6)])
