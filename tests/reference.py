"""The training a workflow must reproduce: plain single-process PyTorch on the same samples, in the
same order, with the same micro-batches and optimizer. The tests compare runs with its parameters;
the runtime benchmark times it as the loop the runtime's overhead is measured against."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from cloudless.compiler.model_file import ModelFile, probe_optimizer
from cloudless.ir.schedule import sample_indices
from cloudless.ir.workflow import DataSource, Region, RunSettings, Workflow


class PlainTrainer:
    """One model and optimizer over samples held in memory; `step(i)` trains iteration i."""

    def __init__(self, model_file: ModelFile, run: RunSettings, items: list[Any]) -> None:
        self.model_file, self.run = model_file, run
        self.model = model_file.build_model()
        # as the functions build it: the model file's torch.optim class and options (SGD without one)
        probe = probe_optimizer(model_file)
        self.optimizer = getattr(torch.optim, probe.class_name)(self.model.parameters(), **probe.options)
        self.inputs = [torch.stack([item[0][j] for item in items]) for j in range(len(items[0][0]))]
        self.targets = torch.stack([torch.as_tensor(item[1]) for item in items])
        self.samples = len(items)

    def step(self, iteration: int) -> None:
        run = self.run
        for m in range(run.micro_batches):
            idx = sample_indices(iteration, m, run.micro_batch, run.global_batch, self.samples, run.seed)
            output = self.model(*[x[idx] for x in self.inputs])
            loss = self.model_file.loss_fn(output, self.targets[idx]) / run.micro_batches
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def region_items(model_file: ModelFile, region: Region) -> list[Any]:
    """A workflow region's training samples: its data sources' slices, else its whole own shard."""
    items: list[Any] = []
    if not region.data_sources:
        dataset = model_file.load_shard(region.name, "train")
        return [dataset[i] for i in range(len(dataset))]
    for source in region.data_sources:
        items.extend(_slice(model_file, source))
    return items


def _slice(model_file: ModelFile, source: DataSource) -> list[Any]:
    dataset = model_file.load_shard(source.region, "train")
    return [dataset[i] for i in range(source.first, source.first + source.count)]


def plain_training(
    model_file: ModelFile,
    workflow: Workflow,
    region: str,
    iterations: int | None = None,
    on_iteration: Callable[[int, float], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Train `iterations` (default: the workflow's) with the region's data in memory; returns the
    parameters and buffers. `on_iteration(i, seconds)` hears each iteration's duration."""
    trainer = PlainTrainer(model_file, workflow.run, region_items(model_file, workflow.region(region)))
    for iteration in range(workflow.run.iterations if iterations is None else iterations):
        began = time.perf_counter()
        trainer.step(iteration)
        if on_iteration is not None:
            on_iteration(iteration, time.perf_counter() - began)
    return trainer.state()


def plain_model_average(model_file: ModelFile, workflow: Workflow, rounds: int) -> dict[str, torch.Tensor]:
    """Several regions with model averaging: each region trains its rounds' iterations on its own
    samples, then every region takes the weighted mean of all regions' models, in region order."""
    regions = workflow.regions
    trainers = [PlainTrainer(model_file, workflow.run, region_items(model_file, region)) for region in regions]
    for round_index in range(rounds):
        for region, trainer in zip(regions, trainers, strict=True):
            k = region.round_iterations
            assert k is not None and region.weight is not None, f"{region.name}: not one of several regions"
            for iteration in range(round_index * k, (round_index + 1) * k):
                trainer.step(iteration)
        states = [t.model.state_dict() for t in trainers]
        mean: dict[str, torch.Tensor] = {}
        for region, state in zip(regions, states, strict=True):
            assert region.weight is not None
            for name, value in state.items():
                if value.is_floating_point():
                    part = region.weight * value
                    mean[name] = mean[name] + part if name in mean else part
        with torch.no_grad():
            for state in states:
                for name, value in mean.items():
                    state[name].copy_(value)
    return trainers[0].state()
