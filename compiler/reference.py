"""The training a workflow must reproduce: plain single-process PyTorch on the same samples, in the
same order, with the same micro-batches and optimizer. The tests compare runs with its parameters;
the runtime benchmark times it as the loop the runtime's overhead is measured against."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from cloudless.compiler.model_file import ModelFile
from cloudless.ir.schedule import sample_indices


class PlainTrainer:
    """One model and optimizer over samples held in memory; `step(i)` trains iteration i."""

    def __init__(self, model_file: ModelFile, workflow: dict[str, Any], items: list[Any]) -> None:
        self.model_file, self.run = model_file, workflow["run"]
        self.model = model_file.build_model()
        self.optimizer = model_file.make_optimizer(self.model.parameters())
        self.inputs = [torch.stack([item[0][j] for item in items]) for j in range(len(items[0][0]))]
        self.targets = torch.stack([torch.as_tensor(item[1]) for item in items])
        self.samples = len(items)

    def step(self, iteration: int) -> None:
        run = self.run
        for m in range(run["micro_batches"]):
            idx = sample_indices(iteration, m, run["micro_batch"], run["global_batch"], self.samples, run["seed"])
            output = self.model(*[x[idx] for x in self.inputs])
            loss = self.model_file.loss_fn(output, self.targets[idx]) / run["micro_batches"]
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def region_items(model_file: ModelFile, entry: dict[str, Any]) -> list[Any]:
    """A workflow region's training samples: its data sources' slices, else its own shard."""
    sources = entry.get("data_sources") or [{"region": entry["name"], "first": 0, "count": None}]
    items = []
    for source in sources:
        dataset = model_file.load_shard(source["region"], "train")
        stop = len(dataset) if source["count"] is None else source["first"] + source["count"]
        items.extend(dataset[i] for i in range(source["first"], stop))
    return items


def plain_training(
    model_file: ModelFile,
    workflow: dict[str, Any],
    region: str,
    iterations: int | None = None,
    on_iteration: Callable[[int, float], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Train `iterations` (default: the workflow's) with the region's data in memory; returns the
    parameters and buffers. `on_iteration(i, seconds)` hears each iteration's duration."""
    entry = next(r for r in workflow["regions"] if r["name"] == region)
    trainer = PlainTrainer(model_file, workflow, region_items(model_file, entry))
    for iteration in range(workflow["run"]["iterations"] if iterations is None else iterations):
        began = time.perf_counter()
        trainer.step(iteration)
        if on_iteration is not None:
            on_iteration(iteration, time.perf_counter() - began)
    return trainer.state()


def plain_model_average(model_file: ModelFile, workflow: dict[str, Any], rounds: int) -> dict[str, torch.Tensor]:
    """Several regions with model averaging: each region trains its rounds' iterations on its own
    samples, then every region takes the weighted mean of all regions' models, in region order."""
    regions = workflow["regions"]
    trainers = [PlainTrainer(model_file, workflow, region_items(model_file, entry)) for entry in regions]
    for round_index in range(rounds):
        for entry, trainer in zip(regions, trainers, strict=True):
            k = entry["round_iterations"]
            for iteration in range(round_index * k, (round_index + 1) * k):
                trainer.step(iteration)
        states = [t.model.state_dict() for t in trainers]
        mean: dict[str, torch.Tensor] = {}
        for entry, state in zip(regions, states, strict=True):
            for name, value in state.items():
                if value.is_floating_point():
                    part = entry["weight"] * value
                    mean[name] = mean[name] + part if name in mean else part
        with torch.no_grad():
            for state in states:
                for name, value in mean.items():
                    state[name].copy_(value)
    return trainers[0].state()
