"""Build function packages for a hand-chosen plan of a sample, and run them on this machine."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from cloudless.compiler.build import package_files, write_build
from cloudless.compiler.cost_model import Plan, StageChoice
from cloudless.compiler.lower import RegionTraining
from cloudless.compiler.pipeline import FrontEndOptions, FrontEndResult, lower_trainings, run_front_end
from cloudless.compiler.reference import plain_training
from cloudless.ir.catalog import load_catalog
from cloudless.runtimes.staging import stage_data
from cloudless.runtimes.storage import DirectoryChannel
from cloudless.runtimes.worker import StageWorker

ROOT = Path(__file__).resolve().parents[1]
MLP = ROOT / "samples" / "mlp_digits.py"


def front_end(model: Path = MLP, batch_size: int = 8) -> FrontEndResult:
    return run_front_end(FrontEndOptions(model_path=model, batch_size=batch_size, profile_repeats=0))


def write_packages(
    result: FrontEndResult,
    build: Path,
    stages: list[tuple[int, int, int]],
    *,
    micro_batch: int,
    global_batch: int,
    iterations: int,
    schedule: str = "gpipe",
) -> dict[str, Any]:
    """Lower a plan of (first block, last block, replicas) stages and write its packages."""
    region = load_catalog(None).region(None)
    plan = Plan(micro_batch, tuple(StageChoice(first, last, 1024, r) for first, last, r in stages))
    lower_trainings(
        result,
        [RegionTraining(region, plan, iterations, None)],
        None,
        iterations=iterations,
        global_batch=global_batch,
        schedule=schedule,  # type: ignore[arg-type]
    )
    write_build(package_files(result), build)
    assert result.workflow is not None
    return result.workflow


def write_training_data(result: FrontEndResult, channel: DirectoryChannel, region: str) -> int:
    return int(stage_data(channel, region, result.model_file.path)["train"])


def run_workers(build: Path, workflow: dict[str, Any], storage: Path, start: int, stop: int) -> list[dict]:
    """Every replica of every stage in its own thread, as the functions would run at once."""
    region = workflow["regions"][0]
    results: list[dict] = []
    errors: list[BaseException] = []

    def work(function: dict[str, Any], replica: int) -> None:
        try:
            worker = StageWorker(build / function["package"], DirectoryChannel(storage))
            results.append(worker.run(start, stop, replica, timeout=60))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f, r)) for f in region["functions"] for r in range(f["replicas"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def reference_training(result: FrontEndResult, workflow: dict[str, Any], region: str) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch on the same samples in the same order: the expected parameters."""
    return plain_training(result.model_file, workflow, region)
