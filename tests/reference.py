"""The training a workflow must reproduce: plain single-process PyTorch on the same samples, in the
same order, with the same micro-batches and optimizer. The tests compare runs with its parameters;
the runtime benchmark times it as the loop the runtime's overhead is measured against."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from cloudless.compiler.frontend.model_file import ModelFile, make_model_optimizer
from cloudless.ir.sample_order import ShardOrder, shard_counts, staged_shard_samples, staging_order
from cloudless.ir.workflow import DataSource, OptimizerSpec, Region, RunSettings, Workflow, round_ends


class PlainTrainer:
    """One model and optimizer over samples held in memory; `step(i)` trains iteration i, at the
    learning rate the workflow's schedule gives iteration i of a region training `iterations`."""

    def __init__(
        self,
        model_file: ModelFile,
        run: RunSettings,
        items: list[Any],
        optimizer: OptimizerSpec,
        iterations: int,
        shard_samples: int | None = None,
        streamed: bool = False,
    ) -> None:
        """`items`: the dataset's (a region's data sources' slices, in order); `shard_samples`: as staged, if
        not by default; `streamed`: the items came from a stream, staged as they came."""
        self.model_file, self.run = model_file, run
        self.model = model_file.build_model()
        # as a plain loop builds it: the model file's make_optimizer over the model (SGD without one)
        self.optimizer = make_model_optimizer(model_file, list(self.model.named_parameters()))
        self.schedule, self.iterations = optimizer, iterations
        self.inputs = [torch.stack([item[0][j] for item in items]) for j in range(len(items[0][0]))]
        self.targets = torch.stack([torch.as_tensor(item[1]) for item in items])
        self.samples = len(items)
        # as the run reads them: the items as staged (in staging_order, so many a shard), in the shards' order
        sample_bytes = sum(x[0].nbytes for x in self.inputs) + self.targets[0].nbytes
        counts = shard_counts(self.samples, shard_samples or staged_shard_samples(sample_bytes))
        self.order = ShardOrder(counts, run.seed)
        self.staged = torch.arange(self.samples) if streamed else staging_order(self.samples)

    def indices(self, iteration: int, micro_batch: int) -> list[int]:
        """The items of micro-batch `micro_batch` of `iteration`, in order."""
        run = self.run
        first = iteration * run.global_batch + micro_batch * run.micro_batch
        return [int(self.staged[located.index]) for located in self.order.span(first, run.micro_batch)]

    def step(self, iteration: int) -> None:
        self.backward(iteration)
        if self.run.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.run.max_grad_norm)
        self.set_learning_rate(iteration)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def set_learning_rate(self, iteration: int) -> None:
        for index, group in enumerate(self.optimizer.param_groups):
            rate = self.schedule.learning_rate(iteration, self.iterations, index if self.schedule.groups else 0)
            if rate is not None:
                group["lr"] = rate

    def backward(self, iteration: int, model: torch.nn.Module | None = None) -> None:
        """Accumulate iteration i's gradients (the mean loss of its global batch) into `model`'s
        (default: this trainer's own)."""
        run, model = self.run, model or self.model
        for m in range(run.micro_batches):
            idx = self.indices(iteration, m)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=run.precision == "bf16-mixed"):
                output = model(*[x[idx] for x in self.inputs])
                loss = self.model_file.loss_fn(output, self.targets[idx]) / run.micro_batches
            loss.backward()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def region_items(model_file: ModelFile, region: Region) -> list[Any]:
    """A workflow region's training samples: its data sources' slices, else its whole own shard."""
    return region_data(model_file, region)[0]


def region_data(model_file: ModelFile, region: Region) -> tuple[list[Any], bool]:
    """`region_items`, and whether they came from a stream (an iterable dataset: staged as it came)."""
    items: list[Any] = []
    if not region.data_sources:
        dataset = model_file.load_shard(region.name, "train")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
            return list(dataset), True
        return [dataset[i] for i in range(len(dataset))], False
    for source in region.data_sources:
        items.extend(_slice(model_file, source))
    return items, False


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
    count = workflow.run.iterations if iterations is None else iterations
    items, streamed = region_data(model_file, workflow.region(region))
    trainer = PlainTrainer(model_file, workflow.run, items, workflow.optimizer, count, streamed=streamed)
    for iteration in range(count):
        began = time.perf_counter()
        trainer.step(iteration)
        if on_iteration is not None:
            on_iteration(iteration, time.perf_counter() - began)
    return trainer.state()


def plain_model_average(
    model_file: ModelFile, workflow: Workflow, iterations: dict[str, int], rounds: int
) -> dict[str, torch.Tensor]:
    """Several regions with model averaging: each region trains its round's iterations on its own
    samples (round k of a region of n iterations ends after `round_ends(n, rounds)[k]`), then every
    region takes the weighted mean of all regions' models, in region order."""
    regions = workflow.regions
    trainers = [
        PlainTrainer(model_file, workflow.run, region_items(model_file, r), workflow.optimizer, iterations[r.name])
        for r in regions
    ]
    ends = {region.name: (0, *round_ends(iterations[region.name], rounds)) for region in regions}
    for round_index in range(rounds):
        for region, trainer in zip(regions, trainers, strict=True):
            assert region.weight is not None, f"{region.name}: not one of several regions"
            for iteration in range(ends[region.name][round_index], ends[region.name][round_index + 1]):
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


def plain_sync(model_file: ModelFile, workflow: Workflow, iterations: int) -> dict[str, torch.Tensor]:
    """Several regions with synchronous SGD: one model; each iteration, every region's gradient on
    its own samples, their mean weighted by the regions' weights (equal without), in region order,
    and one optimizer step."""
    regions = workflow.regions
    trainers = [
        PlainTrainer(model_file, workflow.run, region_items(model_file, r), workflow.optimizer, iterations)
        for r in regions
    ]
    model, optimizer = trainers[0].model, trainers[0].optimizer
    params = list(model.parameters())
    for iteration in range(iterations):
        totals = [torch.zeros_like(p) for p in params]
        for region, trainer in zip(regions, trainers, strict=True):
            weight = region.weight if region.weight is not None else 1.0 / len(regions)
            optimizer.zero_grad(set_to_none=True)
            trainer.backward(iteration, model)
            for total, p in zip(totals, params, strict=True):
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                total.copy_(total + weight * grad)
        for total, p in zip(totals, params, strict=True):
            p.grad = total
        if workflow.run.max_grad_norm is not None:  # the mean gradient's norm, as one process would clip it
            torch.nn.utils.clip_grad_norm_(params, workflow.run.max_grad_norm)
        trainers[0].set_learning_rate(iteration)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return trainers[0].state()
