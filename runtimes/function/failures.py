"""How a function's invocation ends early: the run diverged, the model's own code raised, storage
refused a write, another function aborted the region's run, or the other regions went on without this
one. Each leaves an `AbortRecord` for its neighbours and the controller (`protocol.abort_key`)."""

from __future__ import annotations

from pathlib import Path

from ...ir.protocol import AbortRecord


def one_line(text: str, limit: int = 300) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


class Diverged(RuntimeError):
    """A loss or a parameter is not finite: the run stops (`AbortRecord`)."""

    def __init__(self, record: AbortRecord) -> None:
        super().__init__(record.message)
        self.record = record


class ModelFailed(RuntimeError):
    """The model's own code (forward, loss, backward, optimizer step) raised. It computes the same
    thing on a retry, so the function stops the region's run at once (`AbortRecord`, reason
    failed) rather than let the controller retry it and its neighbours wait for its output."""

    def __init__(self, record: AbortRecord) -> None:
        super().__init__(record.message)
        self.record = record


def where(exc: BaseException) -> str:
    """The innermost frame of an exception as `file:line` (the file's name only: no path of the
    machine it ran on)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})" if tb is not None else ""


class Aborted(RuntimeError):
    """Another function aborted the region's run; this one gives up waiting."""

    def __init__(self, record: AbortRecord) -> None:
        super().__init__(record.message)
        self.record = record


class Abandoned(Aborted):
    """A newer attempt of the range runs (`protocol.attempt_key`): this invocation stops and leaves no
    completion marker, which the newer attempt's invocation of the same range would take for its own."""


class RegionLeft(RuntimeError):
    """The other regions went on without this one: a region that waited for its contribution to a
    meet longer than the region timeout claimed it (`protocol.LEFT_MARK`). The region stops."""

    def __init__(self, record: AbortRecord) -> None:
        super().__init__(record.message)
        self.record = record


class StorageWriteFailed(RuntimeError):
    """Storage refused one of the function's writes (full, read-only, out of memory, gone). Peers wait
    for what it would have written, so the function stops the region's run at once: it records why
    where it still can (`AbortRecord`), every wait of its own ends within a second, and its result
    (status failed) tells the controller, which ends the run with this line instead of a key timeout."""
