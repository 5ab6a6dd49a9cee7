"""Build function packages for a hand-chosen plan of a sample, and run them on this machine."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cloudless.compiler.build import package_files, write_build
from cloudless.compiler.lower import RegionTraining
from cloudless.compiler.pipeline import FrontEnd, FrontEndOptions, lower, retrace, run_front_end
from cloudless.compiler.planner.cost_model import Plan, StageChoice
from cloudless.ir.catalog import load_catalog
from cloudless.ir.files import BUILD_MARKER, build_manifest
from cloudless.ir.folders import write_storage_marker
from cloudless.ir.graph import dumps
from cloudless.ir.protocol import InvocationResult
from cloudless.ir.workflow import Function, StepKind, Workflow
from cloudless.ir.workflow import round_ends as plan_round_ends
from cloudless.runtimes.control.staging import stage_data
from cloudless.runtimes.function.worker import StageWorker, span_step
from cloudless.runtimes.storage.channels import Channel, DirectoryChannel
from tests.reference import plain_training

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "samples" / "mlp_digits.py"


def front_end(model: Path = MLP, batch_size: int = 8) -> FrontEnd:
    return run_front_end(FrontEndOptions(model_path=model, batch_size=batch_size, profile_repeats=0))


def write_packages(
    result: FrontEnd,
    build: Path,
    stages: list[tuple[int, int, int]],
    *,
    micro_batch: int,
    global_batch: int,
    iterations: int,
    schedule: str = "gpipe",
) -> Workflow:
    """Lower a plan of (first block, last block, replicas) stages and write its packages (traced again at
    `micro_batch` when the front end traced another size, as a compile does)."""
    if micro_batch != result.chain.batch_size:
        result = retrace(result, micro_batch, FrontEndOptions(model_path=result.model_file.path))
    region = load_catalog(None).region(None)
    plan = Plan(micro_batch, tuple(StageChoice(first, last, 1024, r) for first, last, r in stages))
    lowered = lower(
        result,
        [RegionTraining(region, plan, iterations, None)],
        None,
        iterations=iterations,
        global_batch=global_batch,
        schedule=schedule,  # type: ignore[arg-type]
    )
    # as a compile writes them; ir/graph.json names the trained model file's keys; the manifest
    # (cloudless-build.json) records every file's digest, which cloudless-run checks
    files = {**package_files(lowered), "ir/graph.json": dumps(result.graph.to_json()).encode()}
    write_build({**files, BUILD_MARKER: build_manifest(files)}, build)
    return lowered.workflow


def write_training_data(result: FrontEnd, channel: DirectoryChannel, region: str) -> int:
    """Stage the training data into a storage folder, marked as cloudless-run marks one it uses (so that
    `--storage` accepts it)."""
    write_storage_marker(channel.root)
    return int(stage_data(channel, region, result.model_file.path)["train"])


def run_workers(
    build: Path,
    workflow: Workflow,
    storage: Path,
    start: int,
    stop: int,
    *,
    run: str = "",
    channel: Callable[[Path], Channel] = DirectoryChannel,
    timeout: float = 60.0,
) -> list[InvocationResult]:
    """Every replica of every stage in its own thread, as the functions would run at once; each
    opens its storage with `channel`."""
    region = workflow.regions[0]
    results: list[InvocationResult] = []
    errors: list[BaseException] = []

    def work(function: Function, replica: int) -> None:
        try:
            worker = StageWorker(build / function.package, channel(storage))
            results.append(worker.run(start, stop, replica, timeout=timeout, run=run))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f, r)) for f in region.functions for r in range(f.replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def reference_training(result: FrontEnd, workflow: Workflow, region: str) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch on the same samples in the same order: the expected parameters."""
    return plain_training(result.model_file, workflow, region)


# --- the worker's order against the workflow's steps ----------------------------------------------


#: one iteration of a worker: (step kind, start, end) of each span, in order
IterationSpans = list[tuple[StepKind, float, float]]


def worker_iterations(spans: list[list[Any]], replicas: int) -> list[IterationSpans]:
    """A worker's spans (its result's, in the order recorded) as the steps they time, one list per
    iteration: (step kind, start, end) per span, by the worker's own `span_step`. An iteration ends
    with its optimizer step and whatever follows it before the next iteration's compute."""
    iterations: list[IterationSpans] = []
    for name, began, ended in spans:
        kind = span_step(name, replicas)
        if kind is None:
            continue
        if not iterations or (kind == "compute" and any(k == "optimizer-step" for k, _, _ in iterations[-1])):
            iterations.append([])
        iterations[-1].append((kind, began, ended))
    return iterations


def _plan_round_ends(workflow: Workflow, region: str) -> tuple[int, ...]:
    planned, rounds = workflow.region(region).iterations, workflow.sync.rounds
    assert planned is not None and rounds is not None, f"{region}: no planned iterations or rounds"
    return plan_round_ends(planned, rounds)


def check_step_order(
    workflow: Workflow, region: str, result: InvocationResult, round_ends: tuple[int, ...] | None = None
) -> list[IterationSpans]:
    """Assert that one invocation ran, in each of its iterations, exactly the workflow's steps of its
    function that fall on that iteration, each once, in an order that is a topological order of the
    steps' `depends_on` among themselves. A step with `every` runs after iterations i with
    (i + 1) % every == 0; a checkpoint is replica 0's, and also ends every invocation; model averaging
    and ASGD-GA's push run after the iterations of `round_ends` (the run's; default the plan's,
    `workflow.round_ends(region.iterations, sync.rounds)`). Returns the
    iterations' spans (for checks across functions)."""
    function = workflow.region(region).function(result.function)
    steps = [s for s in workflow.steps if s.region == region and s.function == function.name]
    assert len({s.kind for s in steps}) == len(steps), f"{function.name}: a step kind listed twice"
    by_id = {s.id: s for s in steps}
    iterations = worker_iterations([list(span) for span in result.spans], function.replicas)
    first, stop = result.resumed, result.stop
    assert len(iterations) == stop - first, f"{function.name} r{result.replica}: {len(iterations)} iterations"
    for offset, spans in enumerate(iterations):
        i = first + offset
        order: list[str] = []
        for kind, _, _ in spans:
            if not order or order[-1] != kind:
                order.append(kind)
        wanted = set()
        for step in steps:
            due = step.every is None or (i + 1) % step.every == 0
            if step.kind in ("model-average", "asgd-ga-push") and step.every is None:
                due = i + 1 in (round_ends if round_ends is not None else _plan_round_ends(workflow, region))
            if step.kind == "checkpoint":
                due = result.replica == 0 and (due or i + 1 == stop)
            if due:
                wanted.add(step.kind)
        where = f"{function.name} replica {result.replica} iteration {i}"
        assert len(order) == len(set(order)), f"{where}: a step's work is split: {order}"
        assert set(order) == wanted, f"{where}: ran {order}, the workflow's steps due are {sorted(wanted)}"
        position = {kind: index for index, kind in enumerate(order)}
        for step in steps:
            for dependency in step.depends_on:
                before = by_id.get(dependency)
                if step.kind in position and before is not None and before.kind in position:
                    assert position[before.kind] < position[step.kind], f"{where}: {step.id} ran before {dependency}"
    return iterations


def compile_pipeline(source: str, model: Path, *options: str) -> tuple[Path, Workflow]:
    """Write the model file's `source` (dedented) to `model` and compile it as 2 stages x 2 replicas beside it
    (build/): the build and its workflow."""
    import textwrap

    import yaml

    from cloudless.compiler.cli import main as compile_main

    model.write_text(textwrap.dedent(source))
    build = model.parent / "build"
    flags = ["--stages", "2", "--replicas", "2", "--repeats", "1", "-q", *options]
    assert compile_main([str(model), "-o", str(build), *flags]) == 0
    workflow = Workflow.from_json(yaml.safe_load((build / "workflow.yaml").read_text()))
    assert [f.replicas for f in workflow.regions[0].functions] == [2, 2]
    return build, workflow
