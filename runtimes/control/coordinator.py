"""The coordinator of a run's regions: each region's plan (its iterations, rounds, replicas and weight),
re-planned as capacities change and regions leave (the re-plan's arithmetic is elastic.py's), and where
each region's ranges stop. `Controller` (controller.py) invokes and follows the ranges it plans."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from typing import Any

from ...ir import protocol
from ...ir.workflow import Region, Workflow, round_meets
from ..storage.channels import Channel
from .elastic import extra_rounds, fit_replicas, share_iterations, slowdown
from .run_state import RegionGone, RegionPlan, RegionRun, RunSettings

#: a re-plan asks a region's range to stop at a meet at least this many iterations past its reported
#: progress (its leading function stops it there or, when already past, 2 iterations on)
CUT_LEAD = 3


class Coordinator:
    """The plans of a run's regions. Set by `Controller.__init__`."""

    workflow: Workflow
    settings: RunSettings
    channel: Channel  # the storage of every region `channels` does not name
    channels: dict[str, Channel]
    lock: threading.RLock
    changed: threading.Condition  # on `lock`: a region's plan changed, or it stopped or left
    cancelled: threading.Event  # Ctrl-C: every region stops
    plans: dict[str, RegionPlan]
    run_rounds: int | None  # the run's rounds now: the plan's, and the new ones re-plans gave it
    ranges: dict[str, tuple[int, int]]  # the range under way per region
    positions: dict[str, int]  # where each region stands between its ranges (or at its end)
    idle: set[str]  # regions at their end, waiting for the run to end or for a re-plan
    exited: set[str]  # regions whose thread ended
    ends: dict[str, int]  # where each region's run ended
    records: dict[str, RegionRun]  # what the run did so far
    events: list[dict[str, Any]]  # what the coordinator did, in order (metrics.json)

    def namespace(self, region: str) -> str:
        return protocol.namespace(self.settings.run_id, region)

    def storage(self, region: str) -> Channel:
        """The storage of `region` (its keys, markers, progress and abort record)."""
        return self.channels.get(region, self.channel)

    def _scale(self) -> float:
        """settings.iterations / the workflow's: how --iterations scales a plan of several regions."""
        return self.settings.iterations / self.workflow.run.iterations

    def region_iterations(self, region: Region) -> int:
        """Iterations a region runs. One region: the settings'. Several: the plan's, `region.iterations`
        (plan = run); when settings.iterations differs from the workflow's run.iterations, every
        region's planned iterations scaled by their ratio (rounded, at least 1)."""
        if len(self.workflow.regions) == 1:
            return self.settings.iterations
        planned = region.iterations if region.iterations is not None else self.workflow.run.iterations
        if self.settings.iterations == self.workflow.run.iterations:
            return planned
        return max(1, round(planned * self._scale()))

    def rounds(self) -> int | None:
        """Several regions: the inter-region rounds of this run (the same in every region): the plan's
        sync.rounds, scaled like the iterations and at most the fewest iterations of a region; under
        `sync` every iteration is a round. None for one region."""
        if len(self.workflow.regions) == 1 or self.workflow.sync.inter_region is None:
            return None
        fewest = min(self.region_iterations(r) for r in self.workflow.regions)
        if self.workflow.sync.inter_region == "sync":
            return fewest
        planned = self.workflow.sync.rounds or fewest
        if self.settings.iterations != self.workflow.run.iterations:
            planned = max(1, round(planned * self._scale()))
        return min(planned, fewest)

    def round_ends(self, name: str) -> tuple[int, ...]:
        """After how many iterations each of the region's rounds ended in this run (several regions),
        under each plan the coordinator gave it."""
        return (*self.plans[name].met, *sorted(self.meets(name)))

    def _next_stop(self, name: str, at: int) -> int | None:
        """Where the region's next range from `at` stops (its end, or its next capacity change); notes the
        range as under way. A region at its end waits there, as a re-plan may give it more iterations (a
        region that leaves later): None once it has left, or once every region is at its end or gone."""
        with self.changed:
            self.positions[name] = at
            while not self.cancelled.is_set():
                plan = self.plans[name]
                if plan.left:
                    return None
                if at < plan.end:
                    self.idle.discard(name)
                    changes = [c.iteration for c in self.settings.capacity_changes if c.region == name]
                    stop = min([plan.end] + [c for c in changes if at < c])
                    self.ranges[name] = (at, stop)
                    return stop
                self.idle.add(name)
                self.changed.notify_all()
                if all(p.left or n in self.idle or n in self.exited for n, p in self.plans.items()):
                    return None  # the run is over: nothing is left to re-plan
                self.changed.wait(1.0)
            return None

    def meets(self, name: str) -> dict[int, int]:
        """The region's meet points under its plan now: iterations done -> the round ending there
        (every iteration under `sync`; none for one region)."""
        plan, rounds = self.plans[name], self.plans[name].rounds
        if rounds is None:
            return {}
        if self.workflow.sync.inter_region == "sync":
            return {i + 1: i for i in range(plan.end)}
        return round_meets(plan.end, rounds, since=plan.since, first_round=plan.first_round)

    def _rounds_done(self, name: str, at: int) -> int:
        """How many of its rounds the region has met after `at` iterations (its plan now)."""
        plan = self.plans[name]
        if self.workflow.sync.inter_region == "sync":
            return min(at, plan.rounds or 0)
        return plan.first_round + sum(1 for end in self.meets(name) if plan.since < end <= at)

    def _range_ended(self, region: Region, at: int) -> None:
        """The region's range stopped at `at`: adopt a re-plan waiting for it, then apply the capacity
        changes due there (re-planning every region)."""
        name = region.name
        plan = self.plans[name]
        self.positions[name] = at
        if plan.next is not None:
            self._adopt(name, plan.next, at)
        for change in self.settings.capacity_changes:
            if change.region != name or change.iteration != at or at >= self.plans[name].end:
                continue
            plan = self.plans[name]
            planned = tuple(f.replicas for f in region.functions)
            fitted = fit_replicas(planned, change.functions)
            self._note("capacity", name, at, functions=change.functions, replicas=list(fitted or ()))
            if fitted is None:
                raise RegionGone(
                    f"{name}: capacity {change.functions} function(s) from iteration {at} cannot hold its "
                    f"{len(planned)} stage(s)",
                    tell=True,
                )
            factor = slowdown(self.workflow.run.micro_batches, plan.replicas, fitted)
            plan.replicas = fitted
            self._replan(name, at, factor)

    def _adopt(self, name: str, new: RegionPlan, at: int) -> None:
        """Region `name` stands at `at` (its range stopped there, or it is between ranges or at its end):
        its plan from there is `new` (its end at least one iteration per round left, the run's new
        rounds included; no iterations where no round is left, as nothing would apply them)."""
        done = self._rounds_done(name, at)
        plan = self.plans[name]
        plan.replicas, plan.weight, plan.next = new.replicas, new.weight, None
        if plan.rounds is None or self.workflow.sync.inter_region == "sync":
            return
        rounds = new.rounds or plan.rounds
        left = rounds - done
        if left:
            plan.met += tuple(end for end in sorted(self.meets(name)) if end <= at)
            plan.end, plan.since, plan.first_round, plan.rounds = max(new.end, at + left), at, done, rounds
        else:
            plan.end = at

    def _seconds_per_iteration(self, name: str) -> float:
        """The region's pace: the median of its last iterations' times (meets included only as the
        median lets them), else the median over all regions, else 1."""
        times = [p.time for p in self.records.get(name, RegionRun()).progress[-21:]]
        steps = [b - a for a, b in zip(times[:-1], times[1:], strict=True) if b >= a]
        if steps:
            return max(statistics.median(steps), 1e-6)
        others = [self._seconds_per_iteration(n) for n in self.plans if n != name and self.records.get(n)]
        return (
            statistics.median(others)
            if others and any(self.records[n].progress for n in self.plans if n != name)
            else 1.0
        )

    def _cut(self, name: str) -> int | None:
        """Ask the region's range under way to stop at a meet a few iterations past its reported progress
        (`protocol.CUT_REQUEST`; its leading function decides where, at that meet or later); the
        iteration asked for, the time limit's decision if one came first, or None where no meet is left
        before the range's end (or no range is under way)."""
        if name not in self.ranges:
            return None
        start, stop = self.ranges[name]
        progress = self.records[name].progress
        reached = progress[-1].iteration + 1 if progress else start
        candidates = [m for m in sorted(self.meets(name)) if reached + CUT_LEAD <= m < stop]
        if not candidates:
            return None
        key = protocol.stop_key(self.namespace(name), start)
        channel = self.storage(name)
        if channel.claim(key, protocol.CUT_REQUEST + str(candidates[0]).encode()):
            return candidates[0]
        decided = channel.try_get(key)
        if decided is None:
            return None
        requested = protocol.cut_request(decided)  # an earlier re-plan's request: this one takes its place
        return requested if requested is not None else (int(decided) if int(decided) < stop else None)

    def _standing(self, name: str) -> int:
        """Where a re-plan takes region `name` from: where it stands between its ranges or at its end
        (finished), else the meet its range under way is asked to stop at (`_cut`), else, with no meet
        left to cut it at, the range's end."""
        if name not in self.ranges:
            return self.positions[name]
        cut = self._cut(name)
        return cut if cut is not None else self.ranges[name][1]

    def _replan(self, trigger: str | None, at: int, factor: float = 1.0) -> None:
        """Re-solve the inter-region level from the current state: the run's iterations not yet trained
        for good (a region that left: what it trained after its last round that counted) go to the
        regions still training, from where each stands (`_standing`), in proportion to their pace (the
        trigger's scaled by `factor`, its new replicas), each at least one per round left. Where no
        region has a round left (the others had finished, or were in their last round), the run gets
        new rounds (`extra_rounds`) and every region still training runs them: a finished one is
        invoked again. A region between ranges or finished takes its new plan now, a range under way
        where it stops. Under `sync` every region runs every iteration: nothing moves."""
        if self.run_rounds is None or self.workflow.sync.inter_region == "sync":
            return
        total = sum(self.region_iterations(r) for r in self.workflow.regions)
        committed, points, least = 0, {}, {}
        for name, plan in self.plans.items():
            if plan.left:
                committed += self.applied_iterations(name) or 0
                continue
            points[name] = self._standing(name)
            least[name] = self.run_rounds - self._rounds_done(name, points[name])
        remaining = total - committed - sum(points.values())
        if remaining > 0 and points and not any(least.values()):
            extra = extra_rounds(remaining, len(points), self.rounds() or 1, total)
            self.run_rounds += extra
            least = dict.fromkeys(points, extra)
        sharing = {name: count for name, count in least.items() if count > 0}  # the others end where they stand
        if not sharing:
            return
        seconds = {n: self._seconds_per_iteration(n) * (factor if n == trigger else 1.0) for n in sharing}
        shares = share_iterations(remaining, seconds, sharing)
        planned = sum(shares.values())
        for name, share in shares.items():
            plan = self.plans[name]
            new = RegionPlan(points[name] + share, plan.replicas, share / planned if planned else None, self.run_rounds)
            if name in self.ranges:
                plan.next = new
            else:
                self._adopt(name, new, points[name])
        self._note(
            "replan",
            trigger or "",
            at,
            iterations={name: points[name] + share for name, share in shares.items()},
            rounds=self.run_rounds,
            seconds_per_iteration={name: round(value, 6) for name, value in seconds.items()},
        )
        self.changed.notify_all()  # a region waiting at its end goes on

    def applied_iterations(self, name: str) -> int | None:
        """Of a region that left (model averaging, ASGD-GA): its iterations the other regions applied, up
        to the end of its last round that counted (`_applied_rounds`). None under `sync` or one region."""
        if self.run_rounds is None or self.workflow.sync.inter_region == "sync":
            return None
        applied = self._applied_rounds(name)
        return self.round_ends(name)[applied - 1] if applied else 0

    def _applied_rounds(self, name: str) -> int:
        """How many of a departed region's rounds the others applied (its functions write no more): its
        round models that are not departure marks (model averaging), its pushes (ASGD-GA); the fewest
        over its stages."""
        region = self.workflow.region(name)
        counts = []
        for stage in range(region.stages):
            if self.workflow.sync.inter_region == "asgd-ga":
                server = self.workflow.sync.server or name
                channel, namespace = self.storage(server), self.namespace(server)
                pushed, version = 0, 1
                while (owner := channel.try_get(protocol.global_key(namespace, stage, version, "owner"))) is not None:
                    pushed += owner.decode().startswith(f"{name}/round")
                    version += 1
                counts.append(pushed)
                continue
            channel, k = self.storage(name), 0
            while True:
                key = protocol.round_key(self.namespace(name), "model-average", stage, k, "model")
                data = channel.try_get(key)
                if data is None or data == protocol.LEFT_MARK:
                    break
                k += 1
            counts.append(k)
        return min(counts, default=0)

    def _leave(self, name: str, why: str, tell: bool) -> None:
        """Region `name` leaves the run: record it, tell the others (unless it went silent: they find
        out by the region timeout), and re-plan the rest."""
        with self.lock:
            plan = self.plans[name]
            if plan.left:
                return
            plan.left = why
            self.ranges.pop(name, None)
            print(f"cloudless-run: {why}; the other regions go on without it", file=sys.stderr, flush=True)
            if tell:
                record = json.dumps({"by": "coordinator", "why": why}).encode()
                try:
                    self.storage(name).claim(protocol.left_key(self.namespace(name)), record)
                except Exception as exc:  # noqa: BLE001 - its storage unreachable: the others time out
                    print(f"cloudless-run: could not record that {name} left: {exc}", file=sys.stderr)
            progress = self.records[name].progress if name in self.records else []
            self._note("left", name, progress[-1].iteration + 1 if progress else 0, why=why)
            if any(not p.left for p in self.plans.values()):
                self._replan(None, 0)

    def _watch_departures(self) -> None:
        """A region another one stopped waiting for (its `left_key` is there) leaves the run."""
        for name, plan in list(self.plans.items()):
            if not plan.left and self.storage(name).exists(protocol.left_key(self.namespace(name))):
                data = self.storage(name).try_get(protocol.left_key(self.namespace(name))) or b"{}"
                why = str(json.loads(data).get("why", "it missed a meet"))
                self._leave(name, f"{name} left the run: {why}", tell=False)

    def _note(self, event: str, region: str, iteration: int, **details: Any) -> None:
        self.events.append({"event": event, "region": region, "iteration": iteration, "time": time.time(), **details})
