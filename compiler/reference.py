"""The training a workflow must reproduce: plain single-process PyTorch on the same samples, in the
same order, with the same micro-batches and optimizer. The tests compare runs with its parameters;
the runtime benchmark times it as the loop the runtime's overhead is measured against."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from cloudless.compiler.model_file import ModelFile
from cloudless.runtimes.data import sample_indices


def plain_training(
    model_file: ModelFile,
    workflow: dict[str, Any],
    region: str,
    iterations: int | None = None,
    on_iteration: Callable[[int, float], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Train `iterations` (default: the workflow's) with the region's data in memory; returns the
    parameters and buffers. `on_iteration(i, seconds)` hears each iteration's duration."""
    model = model_file.build_model()
    optimizer = model_file.make_optimizer(model.parameters())
    dataset = model_file.load_shard(region, "train")
    items = [dataset[i] for i in range(len(dataset))]
    inputs = [torch.stack([item[0][j] for item in items]) for j in range(len(items[0][0]))]
    targets = torch.stack([torch.as_tensor(item[1]) for item in items])
    run = workflow["run"]
    for iteration in range(run["iterations"] if iterations is None else iterations):
        began = time.perf_counter()
        for m in range(run["micro_batches"]):
            idx = sample_indices(iteration, m, run["micro_batch"], run["global_batch"], len(items), run["seed"])
            loss = model_file.loss_fn(model(*[x[idx] for x in inputs]), targets[idx]) / run["micro_batches"]
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if on_iteration is not None:
            on_iteration(iteration, time.perf_counter() - began)
    return {k: v.detach() for k, v in model.state_dict().items()}
