"""A stage's checkpoints and where a retried invocation resumes.

The parameters, buffers and optimizer state before iteration i are at `protocol.state_key` (replica 0
writes them every `checkpoint_every` iterations and when an invocation returns), with a record of the
newest (`protocol.latest_state_key`); a damaged checkpoint falls back to an earlier whole one, and a
damaged record is only a hint that failed: the checkpoints themselves are looked for. What a function
wrote for iterations nobody can need any more is swept (`protocol.sweep_before`).

`Checkpoints` owns no state between calls: what a checkpoint holds is the stage's module and optimizer
(the shared `StageContext`) and region sync's base version (`RegionSync.checkpointed`); its deletes go
to the worker's control threads (`Background`), which the invocation waits for before it returns.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from ...ir import protocol
from ...ir.protocol import CorruptBlob
from ..storage.tensors import pack, unpack
from .region_sync import RegionSync
from .stage_context import Background, InvocationState, StageContext


class Checkpoints:
    """The stage's checkpoints: saved, loaded, found for a retry, and swept."""

    def __init__(
        self, context: StageContext, invocation: InvocationState, background: Background, region_sync: RegionSync
    ) -> None:
        self.context, self.invocation = context, invocation
        self.background = background
        self.region_sync = region_sync  # whose base version (ASGD-GA) a checkpoint holds
        self.every = context.workflow.run.checkpoint_every

    def state_key(self, iteration: int) -> str:
        return protocol.state_key(self.invocation.namespace, self.context.stage, iteration)

    def _record_key(self) -> str:
        return protocol.latest_state_key(self.invocation.namespace, self.context.stage)

    # -- state -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a checkpoint holds: the trained module's state, the optimizer's, region sync's."""
        module, optimizer = self.context.module, self.context.optimizer
        values: dict[str, Any] = {
            f"{protocol.MODULE_PREFIX}{k}": v for k, v in module.state_dict().items() if k not in self.context.frozen
        }
        names = {id(p): n for n, p in module.named_parameters()}
        for param, state in (optimizer.state if optimizer else {}).items():
            for key, value in state.items():
                values[f"{protocol.OPTIMIZER_PREFIX}{names[id(param)]}/{key}"] = value
        values.update(self.region_sync.checkpointed())
        return values

    def save_state(self, iteration: int, start: int = 0) -> None:
        """Checkpoint at `iteration` during an invocation that started at `start`."""
        channel = self.context.channel
        channel.put(self.state_key(iteration), pack(self.state()))
        record = self._record() or {}
        listed = record.get("between")
        between = [i for i in listed if isinstance(i, int) and i != iteration] if isinstance(listed, list) else []
        if iteration % self.every:
            between.append(iteration)
        # A range-end checkpoint before this invocation's start (an earlier invocation's end, which
        # nothing resumes from now) or beyond the sweep's horizon is deleted: else a run of many short
        # (time-limited) invocations would keep one per invocation
        horizon = max(start, protocol.sweep_before(iteration, self.every))
        old = [i for i in between if i < horizon]
        if old:
            self.background.send(self._delete, [self.state_key(i) for i in old])
        record = {"latest": iteration, "between": sorted(i for i in between if i >= horizon)}
        channel.put(self._record_key(), json.dumps(record).encode())

    def _record(self) -> dict[str, Any] | None:
        """The stage's checkpoint record (`protocol.latest_state_key`): None when there is none, {} when it
        is damaged (not sealed whole, not JSON, not an object): the caller then finds the checkpoints
        themselves, and the next checkpoint writes a good record."""
        channel = self.context.channel
        key = self._record_key()
        try:
            data = channel.try_get(key)
            record = None if data is None else json.loads(data)
        except (CorruptBlob, ValueError) as exc:
            print(f"cloudless: the checkpoint record {channel.describe(key)} is damaged ({exc})", file=sys.stderr)
            return {}
        return record if isinstance(record, dict) or record is None else {}

    def load_state(self, iteration: int, timeout: float) -> None:
        """Load the state before `iteration`: the initial weights at 0, else the stage's checkpoint."""
        context, invocation = self.context, self.invocation
        module, optimizer = context.module, context.optimizer
        if iteration == 0:
            module.load_state_dict(context.initial_weights(invocation.namespace, invocation.key_timeout), strict=True)
            values: dict[str, torch.Tensor] = {}
        else:
            values = unpack(context.channel.get(self.state_key(iteration), timeout))
            frozen: dict[str, torch.Tensor] = {}
            if context.frozen:  # not in checkpoints: as the package (or the staged weights) hold them
                initial = context.initial_weights(invocation.namespace, invocation.key_timeout)
                frozen = {name: initial[name] for name in sorted(context.frozen)}
            module.load_state_dict({**frozen, **protocol.module_values(values)}, strict=True)
        self.region_sync.restore(values)
        # The state is the checkpoint's alone: gradients a failed attempt accumulated in this warm process
        # (its backward passes before the failure) would otherwise be added into the retried step's.
        module.zero_grad(set_to_none=True)
        if optimizer is None:
            return
        optimizer.state.clear()
        params = dict(module.named_parameters())
        for key, value in values.items():
            if key.startswith(protocol.OPTIMIZER_PREFIX):
                name, field = key.removeprefix(protocol.OPTIMIZER_PREFIX).rsplit("/", 1)
                optimizer.state[params[name]][field] = value

    #: how many checkpoints past the newest one recorded a retried invocation also looks for (the record
    #: is written after its checkpoint: a crash between the two leaves it one behind)
    RECORD_LAG = 2

    def resume_point(self, start: int, stop: int, attempt: int | None) -> int:
        """The latest checkpoint of this stage in start+1..stop-1: where a retried invocation resumes.
        A first attempt starts at `start` (nothing of its range ran yet) without asking storage; a retry
        reads the stage's record of its newest checkpoint (`protocol.latest_state_key`) and checks that
        one, and the next few multiples of checkpoint_every after it, exist: a few reads, however long
        the range. Only if the record is damaged, or names no checkpoint that is there, does it scan the
        range's multiples of checkpoint_every from the top down (the record is a hint)."""
        if attempt == 0:
            return start
        record = self._record()
        if record is None:  # no record: this stage has no checkpoint in this run
            return start
        every, channel = self.every, self.context.channel
        recorded = record.get("latest")
        if not isinstance(recorded, int) or isinstance(recorded, bool):
            recorded = stop  # damaged: it may have named any of the range's checkpoints
        below = min(recorded, stop - 1)  # the newest may lie past this range (a later range's): look below
        below -= below % every
        hinted = {recorded - recorded % every + k * every for k in range(1, self.RECORD_LAG + 1)}
        hinted |= {recorded} | {below - k * every for k in range(self.RECORD_LAG + 1)}
        for iteration in sorted(hinted, reverse=True):
            if start < iteration < stop and channel.exists(self.state_key(iteration)):
                return iteration
        if recorded <= start:  # the record says: no checkpoint in this range yet
            return start
        # It names one in (or past) this range that is gone, or it is damaged: the checkpoints that are there
        for iteration in range(below - (self.RECORD_LAG + 1) * every, start, -every):
            if channel.exists(self.state_key(iteration)):
                return iteration
        return start

    def load_checkpoint(self, resume: int, timeout: float, start: int) -> int:
        """Load the checkpoint at `resume`; if it is corrupt, the one before it that is whole (an
        invocation replays from there, reading the same tensors its neighbours sent then, which
        they keep: `protocol.sweep_before`). Returns where it resumes; CorruptBlob if none is whole."""
        try:
            self.load_state(resume, timeout)
            return resume
        except CorruptBlob as exc:
            corrupt = exc
        every = self.every
        earlier_ones = set(range((resume - 1) // every * every, max(resume - 2 * every, 0) - 1, -every))
        if start < resume:
            earlier_ones.add(start)
        for earlier in sorted(earlier_ones, reverse=True):
            try:
                if earlier > 0 and not self.context.channel.exists(self.state_key(earlier)):
                    continue
                self.load_state(earlier, timeout)
            except CorruptBlob:
                continue
            print(f"cloudless: {corrupt}; resuming from the checkpoint of iteration {earlier}", file=sys.stderr)
            return earlier
        raise corrupt

    def sweep(self, checkpoint: int, start: int) -> None:
        """Having checkpointed at `checkpoint`: delete what this function wrote for iterations
        before `protocol.sweep_before`, and (replica 0) the stage's checkpoints nobody resumes from
        any more: the one two intervals back, and the one this invocation started from."""
        before = protocol.sweep_before(checkpoint, self.every)
        keys = self.context.channel.owned_before(before)
        if self.invocation.replica == 0:
            if before > 0:
                keys.append(self.state_key(before))
            every = self.every
            if start % every and start < checkpoint - every <= start + every:  # once, the first time
                keys.append(self.state_key(start))
        if keys:
            self.background.send(self._delete, keys)

    def _delete(self, keys: list[str]) -> None:
        """Best effort: a key left behind costs storage (the run's clean-up gets it), not training."""
        channel = self.context.channel
        for key in keys:
            try:
                channel.delete(key)
            except Exception as exc:  # noqa: BLE001 - any back end's error
                print(f"cloudless: could not delete {channel.describe(key)}: {exc}", file=sys.stderr)
