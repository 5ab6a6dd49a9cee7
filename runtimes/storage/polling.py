"""Waiting for a key: polling with back-off, bounded by a timeout, with a check about once a second.

Every wait of the runtime for something another function writes (a stage's activation, a replica's
piece, a peer region's contribution, a global model version) polls storage the same way: the first
poll comes at once, the pauses double from the channel's `poll_s` up to its `max_poll_s`, the wait
ends at its timeout, and a slower check (has the run been aborted, has a peer left) runs about once a
second instead of at every poll.
"""

from __future__ import annotations

import threading
import time


class Backoff:
    """One wait's clock: `pause()` between polls, `expired()` at the timeout, `once_a_second()` for the
    slower checks (first true a second in, or at the first call with `check_at_once`)."""

    def __init__(
        self,
        first_s: float,
        max_s: float,
        timeout: float,
        cancelled: threading.Event | None = None,
        *,
        check_at_once: bool = False,
    ) -> None:
        self.wait, self.max_s, self.timeout, self.cancelled = first_s, max_s, timeout, cancelled
        self.began = time.monotonic()
        self.checked: float | None = None if check_at_once else self.began

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def expired(self) -> bool:
        return time.monotonic() >= self.began + self.timeout

    def once_a_second(self) -> bool:
        now = time.monotonic()
        if self.checked is None or now - self.checked >= 1.0:
            self.checked = now
            return True
        return False

    def pause(self) -> bool:
        """Sleep before the next poll, doubling the pause; True when the wait's event was set (then or
        before): the caller stops waiting."""
        if self.cancelled is not None:
            stop = self.cancelled.wait(self.wait)
        else:
            time.sleep(self.wait)
            stop = False
        self.wait = min(self.wait * 2, self.max_s)
        return stop
