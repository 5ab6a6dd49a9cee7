"""The buffers a stage's forward changes, followed through an iteration so that its replicas end it with the
plain loop's values (the stage file's BUFFER_RULES; compiler/frontend/buffer_rules.py says why each rule is
exact).

Replica j runs micro-batches m = j, j + r, ... in order, each replica from the values the iteration began
with (r0). Around each forward, the buffer's values before (b) and after (a) give that micro-batch's part:
- "average" (momentum α): a = (1-α)·b + α·s_m, so α·s_m = a - (1-α)·b, and the plain loop's sequence of M
  micro-batches ends at (1-α)^M·r0 + Σ_m (1-α)^(M-1-m)·α·s_m; a replica's part is its own terms of the sum;
- "count": a - b, the sequence ending at r0 + Σ_m (a - b).
The replicas' scatter-reduce sums the parts (`parts`, `adopt`); one replica changes nothing.
"""

from __future__ import annotations

import torch

#: a rule as the stage file writes it: (name, momentum)
Rule = tuple[str, float | None]


class BufferUpdates:
    """A stage's buffers under the "average" and "count" rules, and each iteration's parts of them."""

    def __init__(self, module: torch.nn.Module, rules: dict[str, Rule]) -> None:
        buffers = dict(module.named_buffers())
        self.averaged = [
            (buffers[n], float(momentum or 0.0)) for n, (rule, momentum) in rules.items() if rule == "average"
        ]
        self.counted = [buffers[n] for n, (rule, _) in rules.items() if rule == "count"]
        #: buffers whose order replicas cannot reproduce: the plan gives their stage one replica
        self.sequenced = [n for n, (rule, _) in rules.items() if rule == "sequence"]
        self._micro_batches = 0
        self._start: list[torch.Tensor] = []
        self._before: list[torch.Tensor] = []
        self._parts: list[torch.Tensor] = []

    @property
    def tracked(self) -> list[torch.Tensor]:
        return [b for b, _ in self.averaged] + self.counted

    def begin(self, micro_batches: int) -> None:
        """At the iteration's start, before its first forward (every replica holds the same values)."""
        self._micro_batches = micro_batches
        self._start = [b.detach().clone() for b in self.tracked]
        self._parts = [torch.zeros(b.shape, dtype=torch.float32) for b in self.tracked]

    def before_forward(self) -> None:
        self._before = [b.detach().clone() for b in self.tracked]

    def after_forward(self, m: int) -> None:
        """Add micro-batch m's part (m: its place among the iteration's micro-batches)."""
        averaged = len(self.averaged)
        for i, (buffer, momentum) in enumerate(self.averaged):
            weight = (1.0 - momentum) ** (self._micro_batches - 1 - m)
            self._parts[i] += weight * (buffer.detach().float() - (1.0 - momentum) * self._before[i].float())
        for i, buffer in enumerate(self.counted, start=averaged):
            self._parts[i] += (buffer.detach() - self._before[i]).float()

    def parts(self) -> list[torch.Tensor]:
        """This replica's parts, flat, to be summed over the stage's replicas."""
        return [p.reshape(-1) for p in self._parts]

    def adopt(self, sums: list[torch.Tensor]) -> None:
        """Set the buffers from the parts summed over the replicas: the plain loop's values."""
        averaged = len(self.averaged)
        with torch.no_grad():
            for i, (buffer, momentum) in enumerate(self.averaged):
                start = self._start[i].float() * (1.0 - momentum) ** self._micro_batches
                buffer.copy_((start + sums[i].view(buffer.shape)).to(buffer.dtype))
            for i, buffer in enumerate(self.counted, start=averaged):
                buffer.copy_(self._start[i] + sums[i].view(buffer.shape).round().to(buffer.dtype))
