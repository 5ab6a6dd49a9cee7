"""The timeline of one training iteration: which task ran on which function's lane, and when.

The compiler's simulator (`cloudless.compiler.planner.simulate`) produces it and the report
(`cloudless.codegen.report`) draws it; it lives here so that neither imports the other. Standard
library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Lane = Literal["compute", "download", "upload"]
#: the three lanes of every function, which work at once; in the order the report draws them
LANES: tuple[Lane, ...] = ("compute", "download", "upload")


@dataclass(frozen=True)
class Span:
    """One task as it ran: on which function and lane, what, for which micro-batch, when."""

    stage: int
    replica: int
    lane: Lane
    kind: str  # forward, backward, recv-activation, send-activation, recv-gradient, send-gradient, sync-*, update
    micro_batch: int | None
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """One iteration: its length in seconds and its spans, ordered by start (then stage, replica, lane)."""

    iteration_s: float
    spans: tuple[Span, ...]

    def busy(self, stage: int, replica: int, lane: Lane) -> float:
        """Seconds the lane of replica `replica` of stage `stage` spends working."""
        return sum(s.end - s.start for s in self.spans if (s.stage, s.replica, s.lane) == (stage, replica, lane))
