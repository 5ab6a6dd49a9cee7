"""What the parts of a stage worker share, each handed to them explicitly (worker.py composes the parts).

- `StageContext`: the function's facts from its package, built once by `StageWorker.__init__` and never
  reassigned: the workflow, this function and its stage's place in the region, the stage's module and
  optimizer, the parameters the model froze, the function's storage (its counted link and its channel)
  and CPU share. Its methods are the helpers every part uses on the model: the initial weights, the
  trained parameters, running the model's own code, the finiteness check.
- `InvocationState`: what `StageWorker.run` sets for each invocation (the run's namespace, the replica,
  the stage's replicas and 1F1B window, the region's iterations, the key timeout). Every part holds the
  same object and reads it when it acts, so a warm worker's parts follow each new invocation.
- `Background`: the function's control threads and the requests an invocation waits for before it
  returns; `Span`: one piece of work on the invocation's timeline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

from ...ir.protocol import AbortRecord
from ...ir.workflow import Function, Workflow
from ..storage.emulation import CpuShare, EmulatedChannel
from .failures import Aborted, Diverged, ModelFailed, one_line, where
from .function_channel import FunctionChannel
from .initial_weights import package_weights

_T = TypeVar("_T")
_P = ParamSpec("_P")


@dataclass(frozen=True, eq=False)
class StageContext:
    """The function's facts from its package (frozen: no part reassigns them; the module and optimizer
    themselves are trained in place)."""

    package: Path
    workflow: Workflow
    region: str
    function: Function
    stage: int
    stages: int
    first: bool
    last: bool
    #: the region's iterations and every stage's replicas, as planned (an invocation may say otherwise)
    planned_iterations: int | None
    planned_replicas: tuple[int, ...]
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None  # None: the stage trains no parameter
    optimizer_groups: tuple[int, ...]  # per torch parameter group, its index among the workflow's groups
    #: parameters the model froze: as the package's weights hold them, never trained, synced or checkpointed
    frozen: frozenset[str]
    link: EmulatedChannel  # every request of the function, counted (and emulated)
    channel: FunctionChannel  # the link, as the function sees storage (owned keys, waits that notice an abort)
    cpu: CpuShare

    def initial_weights(self, namespace: str, timeout: float) -> dict[str, torch.Tensor]:
        """The stage's tensors as training starts: its package's weights and, for a staged build, the
        parameters the run (`namespace`) put into storage (staged_weights.py)."""
        return package_weights(self.package, self.function, self.channel, namespace, timeout)

    def trained_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters the stage trains: not those the model froze (`Function.frozen_parameters`)."""
        return trained_parameters(self.module, self.frozen)

    def model_code(self, iteration: int, replica: int, what: str, call: Callable[[], _T]) -> _T:
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
                f"{replica}) raised {type(exc).__name__}: {one_line(str(exc))}{where(exc)}"
            )
            raise ModelFailed(AbortRecord("failed", message, iteration, self.stage, self.function.name)) from exc

    def check_finite(self, iteration: int, replica: int, losses: list[float]) -> None:
        """Raise Diverged if a loss of this iteration, or a parameter after its step, is not finite."""
        bad = next((x for x in losses if not math.isfinite(x)), None)
        what = f"the loss is {bad}" if bad is not None else ""
        if not what and not all(bool(torch.isfinite(p).all()) for p in self.module.parameters()):
            what = "a parameter is not finite after the optimizer step"
        if what:
            message = (
                f"iteration {iteration}: {what} on stage {self.stage} ({self.function.name}, replica "
                f"{replica}): training diverged; lower the learning rate or check the data"
            )
            raise Diverged(AbortRecord("diverged", message, iteration, self.stage, self.function.name))


def trained_parameters(module: torch.nn.Module, frozen: frozenset[str]) -> list[tuple[str, torch.nn.Parameter]]:
    """`module`'s parameters but those in `frozen`, in the module's order."""
    return [(n, p) for n, p in module.named_parameters() if n not in frozen]


@dataclass
class InvocationState:
    """The invocation's settings, set by `StageWorker.run` before it iterates."""

    namespace: str  # keys of one run: "<run>/<region>"
    replica: int
    replicas: int  # the stage's, in this invocation's plan of the region
    window: int  # the stage's 1F1B window for those replicas
    iterations: int  # the region's iterations in this run: what the learning-rate schedule stretches over
    key_timeout: float  # how long any wait for a key may take


class Background:
    """Two threads for control requests off the critical path (reports, deletes, stop lookups), and
    the requests among them an invocation waits for before it returns (`send`, `drain`)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None  # started at the first request
        self._pending: list[Future[None]] = []

    def submit(self, call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """Run `call` on a control thread; the caller keeps the future (a lookup it may cancel)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="control")
        return self._pool.submit(call, *args, **kwargs)

    def send(self, call: Callable[_P, None], *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Run `call` on a control thread; the invocation waits for it before it returns (`drain`)."""
        self._pending.append(self.submit(call, *args, **kwargs))

    def wait_until(self, pending: int) -> None:
        """Wait for the oldest requests sent until at most `pending` are outstanding."""
        while len(self._pending) > pending:
            self._pending.pop(0).result()

    def drain(self) -> None:
        """Wait for every request sent (raising the first one's error, as `Future.result` does)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Cancel what has not started; the threads end after what they are doing."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool, self._pending = None, []


class Span:
    """Times a piece of work for the timeline: [name, wall-clock start, end] in seconds."""

    def __init__(self, spans: list[list[Any]], name: str) -> None:
        self.spans, self.name = spans, name

    def __enter__(self) -> None:
        self.began = time.time()

    def __exit__(self, *exc: object) -> None:
        self.spans.append([self.name, round(self.began, 6), round(time.time(), 6)])
