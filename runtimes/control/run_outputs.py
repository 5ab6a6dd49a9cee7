"""What a run writes into its output folder besides the model: the figures of metrics.json (one region's
summary, and a run of several regions' own) and trace.json (Chrome's trace format). `RunMetrics`
(run_state.py) holds them and writes the file."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

from ...ir.workflow import Workflow
from ..storage.emulation import EmulatedChannel
from .controller import Controller
from .cost import data_moves, measured_cost
from .run_state import RegionRun, RunSettings
from .storage_locations import shown


def chrome_trace(record: RegionRun, workflow: Workflow, origin: float) -> dict[str, Any]:
    """The timeline: one process row per function, one thread row per replica; each invocation with
    the forward/backward of each micro-batch, sync, step and checkpoint inside it."""
    functions = {f.name: f for _, f in workflow.functions()}
    events: list[dict[str, Any]] = []
    for name, function in sorted(functions.items(), key=lambda kv: kv[1].stage):
        pid = function.stage
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"stage {pid}: {name}"}})
        for replica in range(function.replicas):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": replica, "args": {"name": f"replica {replica}"}}
            )

    def span(name: str, pid: int, tid: int, began: float, ended: float, cat: str, **args: Any) -> dict[str, Any]:
        return {
            "ph": "X",
            "name": name,
            "cat": cat,
            "pid": pid,
            "tid": tid,
            "ts": round((began - origin) * 1e6),
            "dur": max(1, round((ended - began) * 1e6)),
            "args": args,
        }

    for inv in record.invocations:
        pid = functions[inv["function"]].stage
        events.append(
            span(
                f"invocation from {inv['start']} (attempt {inv['attempt']}, {inv['status']})",
                pid,
                inv["replica"],
                inv["launched"],
                inv["ended"],
                "invocation",
                error=inv["error"],
            )
        )
    for result in record.results:
        pid = functions[result.function].stage
        for name, began, ended in result.spans:
            cat = name.split()[0]
            events.append(span(name, pid, result.replica, began, ended, cat))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def summarise(
    record: RegionRun, workflow: Workflow, settings: RunSettings, seconds: float, test: dict | None
) -> dict[str, Any]:
    times = [p.time for p in record.progress]
    # A report rebuilt from an invocation's result (its own was lost or swept) has no time of its own:
    # it repeats the one before, and its zero step is no measurement.
    steps = [b - a for a, b in zip(times[:-1], times[1:], strict=True) if b > a]
    iteration_s = statistics.median(steps) if steps else None
    storage: dict[str, dict[str, int]] = {}
    for result in record.results:
        counts = storage.setdefault(result.function, {})
        for k, v in result.storage.items():
            counts[k] = counts.get(k, 0) + v
    batch = workflow.run.global_batch
    return {
        "run_id": settings.run_id,
        "iterations": settings.iterations,
        "global_batch": batch,
        "seconds": round(seconds, 3),
        "median_iteration_s": round(iteration_s, 6) if iteration_s else None,
        "samples_per_s": round(batch / iteration_s, 3) if iteration_s else None,
        "final_loss": next((p.loss for p in reversed(record.progress) if not math.isnan(p.loss)), None),
        "test": test,
        "invocations": len(record.invocations),
        "retries": record.retries,
        "faults_injected": record.faults,
        "storage_requests": storage,
        "lost_reports": record.lost_reports,
        "progress": [
            {"iteration": p.iteration, "loss": None if math.isnan(p.loss) else p.loss, "time": round(p.time, 6)}
            for p in record.progress
        ],
        "invocation_log": record.invocations,
    }


def left_figures(controller: Controller, name: str) -> dict[str, Any]:
    """metrics.json of a region that left: why, and (model averaging, ASGD-GA) its iterations the others
    applied, up to its last round that counted (the rest were re-planned onto the regions that stayed)."""
    applied = controller.applied_iterations(name)
    return {"left": controller.plans[name].left} | ({"applied_iterations": applied} if applied is not None else {})


def several_regions_figures(
    args: argparse.Namespace,
    workflow: Workflow,
    controller: Controller,
    records: dict[str, RegionRun],
    locations: dict[str, str],
    counters: dict[str, EmulatedChannel],
    counted: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """What a run of several regions measured beyond each region's figures: the elastic events, the
    model-averaging rounds, where each region's storage was, the measured cost, ASGD-GA's pushes."""
    figures: dict[str, Any] = {"inter_region": workflow.sync.inter_region}
    if controller.events:
        figures["elastic"] = controller.events
    if workflow.sync.inter_region == "model-average":
        figures["rounds"] = controller.round_members()
    figures["storage"] = {name: shown(where) for name, where in locations.items()}
    figures["wan_emulated"] = bool(args.emulate)
    requests = {
        name: {k: v - counted[name].get(k, 0) for k, v in counter.counts.items()} for name, counter in counters.items()
    }
    figures["cost"] = measured_cost(
        workflow,
        {name: r.invocations for name, r in records.items()},
        {name: r.results for name, r in records.items()},
        controller=requests,
        data_moves=data_moves(workflow, controller.storage),
    )
    if workflow.sync.inter_region == "asgd-ga":
        pushes = [push.to_json() for push in controller.asgd_pushes()]
        figures["asgd_pushes"] = pushes
        figures["asgd_staleness"] = {
            "bound": workflow.sync.staleness_bound,
            "max": max((p["staleness"] for p in pushes), default=0),
            "rebased": sum(p["rebased"] for p in pushes),
        }
    return figures
