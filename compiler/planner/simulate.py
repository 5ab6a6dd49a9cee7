"""Event-driven simulation of one training iteration of a plan.

Written apart from the closed form in cost_model.py: it takes only the primitive quantities (compute
seconds per micro-batch, bytes per transfer, link bandwidth and latency, optimizer stream rate) and
derives the timeline by playing every task through the resources that run it. Each replica of each
stage is a function with three lanes that work at once: compute, download link, upload link. A lane
runs its tasks one at a time in the order the schedule gives it (receives are issued ahead, in the
order compute will need them), and a task starts when its lane is free and every task it depends on
has finished. The iteration ends when the last optimizer step does.

The timeline it yields is what the report draws and what `cloudless-run` measurements are compared
with; tests hold it within 10% of the closed form across random plans.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass

from ...ir.schedule import (
    SYNC_IN_FLIGHT,
    SYNC_MAX_POLL_S,
    compute_order,
    local_micro_batches,
    one_f_one_b_windows,
)
from ...ir.timeline import LANES, Lane, Span, Timeline
from .cost_model import CostModel, Plan, Problem, sync_pieces

# The simulator's output types live in the ir (the report draws them without importing the compiler);
# re-exported for the simulator's callers.
__all__ = ["LANES", "Lane", "Span", "Timeline", "simulate"]


@dataclass
class _Task:
    stage: int
    replica: int
    lane: Lane
    kind: str
    micro_batch: int | None
    duration: float
    deps: list[int]
    delay: float = 0.0  # after its dependencies are done, before it can start
    start: float = math.nan
    end: float = math.nan


class _Simulation:
    """Tasks queued per lane in a fixed order; completions drive the clock."""

    def __init__(self) -> None:
        self.tasks: list[_Task] = []
        self.queues: dict[tuple[int, int, Lane], list[int]] = defaultdict(list)

    def add(
        self,
        stage: int,
        replica: int,
        lane: Lane,
        kind: str,
        duration: float,
        deps: list[int | None],
        micro_batch: int | None = None,
        delay: float = 0.0,
    ) -> int:
        index = len(self.tasks)
        task = _Task(stage, replica, lane, kind, micro_batch, duration, [d for d in deps if d is not None], delay)
        self.tasks.append(task)
        self.queues[(stage, replica, lane)].append(index)
        return index

    def run(self) -> Timeline:
        position = dict.fromkeys(self.queues, 0)
        free_at = dict.fromkeys(self.queues, 0.0)
        busy = dict.fromkeys(self.queues, False)
        waiting_on: dict[int, list[tuple[int, int, Lane]]] = defaultdict(list)
        events: list[tuple[float, int]] = []
        done = [False] * len(self.tasks)

        def try_start(lane: tuple[int, int, Lane], now: float) -> None:
            if busy[lane] or position[lane] >= len(self.queues[lane]):
                return
            index = self.queues[lane][position[lane]]
            task = self.tasks[index]
            pending = [d for d in task.deps if not done[d]]
            if pending:
                waiting_on[pending[0]].append(lane)
                return
            task.start = max(now, free_at[lane], max((self.tasks[d].end for d in task.deps), default=0.0) + task.delay)
            task.end = task.start + task.duration
            busy[lane] = True
            heapq.heappush(events, (task.end, index))

        for lane in self.queues:
            try_start(lane, 0.0)
        finished = 0
        while events:
            now, index = heapq.heappop(events)
            task = self.tasks[index]
            done[index] = True
            finished += 1
            lane = (task.stage, task.replica, task.lane)
            busy[lane] = False
            free_at[lane] = now
            position[lane] += 1
            try_start(lane, now)
            for blocked in waiting_on.pop(index, []):
                try_start(blocked, now)
        if finished != len(self.tasks):
            raise RuntimeError(f"simulation deadlocked with {len(self.tasks) - finished} tasks left")
        spans = tuple(
            Span(t.stage, t.replica, t.lane, t.kind, t.micro_batch, t.start, t.end)
            for t in sorted(self.tasks, key=lambda t: (t.start, t.stage, t.replica, LANES.index(t.lane)))
        )
        return Timeline(max((t.end for t in self.tasks), default=0.0), spans)


def simulate(problem: Problem, plan: Plan) -> Timeline:
    """The timeline of one iteration of `plan`: micro-batch m runs on replica m mod r of each stage."""
    model = CostModel(problem)
    blocks = problem.blocks
    scale = plan.micro_batch / problem.profile_batch
    micro_batches = problem.global_batch // plan.micro_batch
    n_stages = len(plan.stages)
    sim = _Simulation()
    # Task ids by (stage, kind, micro-batch), for the dependencies across stages.
    sent_activation: dict[tuple[int, int], int] = {}
    sent_gradient: dict[tuple[int, int], int] = {}
    stage_plans = []
    for s, choice in enumerate(plan.stages):
        chunk = blocks[choice.first : choice.last + 1]
        kappa = model.kappa(choice.tier_mb)
        bandwidth = model.bandwidth(choice.tier_mb)
        first, last = s == 0, s == n_stages - 1
        stage_plans.append(
            {
                "forward": kappa * scale * sum(b.forward_s for b in chunk),
                "backward": kappa * scale * sum(b.backward_s for b in chunk),
                "in_bytes": scale * chunk[0].input_bytes,
                "out_bytes": 0.0 if last else scale * chunk[-1].output_bytes,
                "grad_in_bytes": 0.0 if first else scale * chunk[0].input_bytes,
                "bandwidth": bandwidth,
                "params": model.stage_params(choice.first, choice.last),
                "stream_rate": model.update_rate(choice.tier_mb),
            }
        )

    def transfer_s(size: float, bandwidth: float) -> float:
        return model.latency + size / bandwidth

    # Stages are added last to first so that a stage's receives can name the sends they wait for
    # in the backward direction; forward receives are wired after all stages exist.
    windows = one_f_one_b_windows([c.replicas for c in plan.stages])
    forward_receives: list[tuple[int, int, int]] = []  # (task, stage, micro-batch)
    last_backward: dict[tuple[int, int], int | None] = {}
    for s in reversed(range(n_stages)):
        choice, info = plan.stages[s], stage_plans[s]
        first, last = s == 0, s == n_stages - 1
        for j in range(choice.replicas):
            local = local_micro_batches(micro_batches, choice.replicas, j)
            order = compute_order(problem.schedule, local, windows[s])
            receive: dict[tuple[str, int], int] = {}
            # Downlink: receives in the order compute needs them.
            for kind, m in order:
                if kind == "forward":
                    if first:  # the micro-batch's share of the data's shards, as the cost model reads them
                        duration = model.first_stage_read_s(plan.micro_batch, info["in_bytes"], info["bandwidth"])
                    else:
                        duration = transfer_s(info["in_bytes"], info["bandwidth"])
                    task = sim.add(s, j, "download", "recv-activation", duration, [], m)
                    if not first:
                        forward_receives.append((task, s, m))
                    receive[(kind, m)] = task
                elif not last:
                    dep = sent_gradient[(s + 1, m)]
                    receive[(kind, m)] = sim.add(
                        s, j, "download", "recv-gradient", transfer_s(info["out_bytes"], info["bandwidth"]), [dep], m
                    )
            computed: dict[tuple[str, int], int] = {}
            for kind, m in order:
                deps: list[int | None] = [receive.get((kind, m))]
                if kind == "backward":
                    deps.append(computed[("forward", m)])
                computed[(kind, m)] = sim.add(s, j, "compute", kind, info[kind], deps, m)
            # Uplink: each result leaves as soon as it is computed (none after the ends of the chain).
            sends = {
                "forward": ("send-activation", info["out_bytes"], sent_activation, not last),
                "backward": ("send-gradient", info["grad_in_bytes"], sent_gradient, not first),
            }
            for kind, m in order:
                label, size, sent, needed = sends[kind]
                if needed:
                    duration = transfer_s(size, info["bandwidth"])
                    sent[(s, m)] = sim.add(s, j, "upload", label, duration, [computed[(kind, m)]], m)
            last_backward[(s, j)] = computed[order[-1]] if order else None
    for task, s, m in forward_receives:
        sim.tasks[task].deps.append(sent_activation[(s - 1, m)])

    synced = {
        s: _add_sync(sim, s, [last_backward[(s, j)] for j in range(choice.replicas)], stage_plans[s], model.latency)
        for s, choice in enumerate(plan.stages)
    }
    if problem.clipped:
        synced = _add_clipping(sim, synced, model.latency)
    for s, choice in enumerate(plan.stages):
        update_s = (2 + problem.optimizer_state) * stage_plans[s]["params"] / stage_plans[s]["stream_rate"]
        for j in range(choice.replicas):
            sim.add(s, j, "compute", "update", update_s, list(synced[s][j]))
    return sim.run()


def _add_clipping(
    sim: _Simulation, synced: dict[int, dict[int, list[int | None]]], latency: float
) -> dict[int, dict[int, list[int | None]]]:
    """Gradient clipping's exchange (runtimes/function/replica_sync.py): once a stage's replicas are synced,
    replica 0 writes the stage's squared norm; every replica then reads the other stages' at once
    (found (L + p)/2 after they are written, as a sync piece is), and steps after that."""
    found = latency + (latency + SYNC_MAX_POLL_S) / 2
    norms = {
        s: sim.add(s, 0, "upload", "clip-norm", 0.0, list(by_replica[0]), delay=latency)
        for s, by_replica in synced.items()
    }
    if len(synced) == 1:
        # alone, a stage reads no norm: only replica 0, which writes it, waits for its put
        return {
            s: {j: [*deps, *([norms[s]] if j == 0 else [])] for j, deps in by_replica.items()}
            for s, by_replica in synced.items()
        }
    return {
        s: {
            j: [
                sim.add(
                    # replica 0 reads after its own put, as the worker does
                    s,
                    j,
                    "download",
                    "clip-norms",
                    0.0,
                    [*deps, *(norms[t] for t in synced if t != s or j == 0)],
                    delay=found,
                )
            ]
            for j, deps in by_replica.items()
        }
        for s, by_replica in synced.items()
    }


def _add_sync(
    sim: _Simulation,
    stage: int,
    ready: list[int | None],
    info: dict[str, float],
    latency: float,
) -> dict[int, list[int | None]]:
    """Pipelined scatter-reduce among the stage's replicas (each starting when its task `ready[j]`,
    its last backward, is done); per replica, the tasks its optimizer step waits for.

    Replica i owns chunk i of the gradient. It uploads chunk (i+d) mod r for d = 1..r-1 while
    downloading its own chunk from replica (i-d) mod r, then uploads its reduced chunk and downloads
    the reduced chunk of every other replica, also from (i-d) mod r (`gather_sources` order).
    Chunks move in pieces."""
    r = len(ready)
    params, bandwidth = info["params"], info["bandwidth"]
    synced: dict[int, list[int | None]] = {j: [ready[j]] for j in range(r)}
    if r > 1:
        # Each direction keeps SYNC_IN_FLIGHT requests going: a request's latency overlaps the
        # transfers before it on its link, which moves a piece every `pace`; a piece is done at the
        # earliest L + x/B after what it waits for.
        pieces = sync_pieces(params, r)
        transfer = params / (r * pieces) / bandwidth
        pace = max(transfer, (latency + transfer) / SYNC_IN_FLIGHT)
        delay = latency + transfer - pace
        found = delay + (latency + SYNC_MAX_POLL_S) / 2  # a download also has to find its piece
        scattered: dict[tuple[int, int, int], int] = {}  # (sender, chunk, piece) -> upload task
        for i in range(r):
            for p in range(pieces):
                for d in range(1, r):
                    scattered[(i, (i + d) % r, p)] = sim.add(
                        stage, i, "upload", "sync-scatter", pace, [ready[i]], delay=delay
                    )
        received: dict[tuple[int, int, int], int] = {}  # (owner, sender, piece) -> download task
        for i in range(r):
            for p in range(pieces):
                for d in range(1, r):
                    j = (i - d) % r
                    received[(i, j, p)] = sim.add(
                        stage, i, "download", "sync-scatter", pace, [scattered[(j, i, p)]], delay=found
                    )
        gathered: dict[tuple[int, int], int] = {}
        for i in range(r):
            # Piece p of the reduced chunk is complete once it arrived from every other replica.
            for p in range(pieces):
                arrived = [received[(i, (i - d) % r, p)] for d in range(1, r)]
                gathered[(i, p)] = sim.add(stage, i, "upload", "sync-gather", pace, [*arrived, ready[i]], delay=delay)
        for i in range(r):
            downloads: list[int | None] = [
                sim.add(stage, i, "download", "sync-gather", pace, [gathered[((i - d) % r, p)]], delay=found)
                for d in range(1, r)
                for p in range(pieces)
            ]
            synced[i] = downloads + [gathered[(i, p)] for p in range(pieces)]
    return synced
