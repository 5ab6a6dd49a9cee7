"""A model file's learning-rate schedule (`make_scheduler(optimizer, iterations)`): the compiler
records each iteration's rate from torch's own scheduler, refuses what it cannot follow with one
error, and the functions train with those rates as a plain PyTorch loop with the scheduler does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cloudless.compiler.errors import ModelFileError
from cloudless.compiler.frontend.model_file import load_model_file, probe_learning_rates
from cloudless.ir.workflow import OptimizerSpec, Workflow
from cloudless.runtimes.cli import main as run_main
from tests.reference import PlainTrainer, region_items

MODEL = """\
import torch

TRAINING = {"global_batch_size": 16, "micro_batch_sizes": [8], "iterations": 12}

def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

def example_inputs(batch_size):
    return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(1)),)

def example_targets(batch_size):
    return torch.zeros(batch_size, dtype=torch.int64)

def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)

class _Data(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x[:, 0] > 0).long() + 2 * (self.x[:, 1] > 0).long()
    def __len__(self):
        return len(self.y)
    def __getitem__(self, i):
        return (self.x[i],), self.y[i]

def load_shard(region, split):
    return _Data(96 if split == "train" else 32)
"""

SCHEDULERS = {
    "cosine": "torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=iterations)",
    "steps": "torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[3, 7], gamma=0.3)",
    "warm-up then cosine": (
        "torch.optim.lr_scheduler.SequentialLR(optimizer, [torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, "
        "total_iters=3), torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=iterations - 3)], [3])"
    ),
    "one cycle": (
        "torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=iterations, cycle_momentum=False)"
    ),
}


def with_scheduler(body: str) -> str:
    return MODEL + f"\ndef make_scheduler(optimizer, iterations):\n    return {body}\n"


def torch_rates(path: Path, iterations: int) -> list[float]:
    """The learning rate of each iteration of a plain loop: optimizer step, then scheduler step."""
    model_file = load_model_file(path)
    assert model_file.make_optimizer is not None and model_file.make_scheduler is not None
    model = model_file.build_model()
    optimizer = model_file.make_optimizer(model.parameters())
    scheduler = model_file.make_scheduler(optimizer, iterations)
    rates = []
    for _ in range(iterations):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_the_rates_are_the_schedulers_at_each_iteration(model_file, kind: str) -> None:
    path = model_file(with_scheduler(SCHEDULERS[kind]))
    rates = probe_learning_rates(load_model_file(path), 12)
    assert rates is not None and list(rates) == torch_rates(path, 12)
    assert len(set(rates)) > 1  # it does change the rate


def test_no_scheduler_no_rates(model_file) -> None:
    assert probe_learning_rates(load_model_file(model_file(MODEL)), 12) is None


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("None", "make_scheduler returned builtins.NoneType; return a torch.optim.lr_scheduler scheduler"),
        ("torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)", "ReduceLROnPlateau, which follows a metric"),
        (
            "torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), 2)",
            "make_scheduler's scheduler drives another optimizer",
        ),
        ("torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1 - i / 4)", "learning rate at iteration 5 is -0.05"),
        ("torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1 / (4 - i))", "step 4 of make_scheduler's LambdaLR"),
        (
            "torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=iterations)",
            "OneCycleLR changes the optimizer's momentum at iteration 0",
        ),
    ],
)
def test_a_schedule_the_functions_cannot_follow_is_one_error(model_file, body: str, expected: str) -> None:
    with pytest.raises(ModelFileError, match="model.py") as error:
        probe_learning_rates(load_model_file(model_file(with_scheduler(body))), 12)
    assert expected in str(error.value)


def test_the_stretched_schedule_walks_every_rate_once_when_the_iterations_match() -> None:
    spec = OptimizerSpec("SGD", {"lr": 1.0}, tuple(float(i) for i in range(10)))
    assert [spec.learning_rate(i, 10) for i in range(10)] == list(range(10))
    # a region training half the iterations walks the whole schedule, every other rate
    assert [spec.learning_rate(i, 5) for i in range(5)] == [0, 2, 4, 6, 8]
    assert [spec.learning_rate(i, 20) for i in range(20)] == [i // 2 for i in range(20)]
    assert OptimizerSpec("SGD").learning_rate(3, 10) is None


@pytest.mark.slow
def test_a_run_trains_with_the_schedule_as_plain_pytorch_does(model_file, compile_cli, tmp_path: Path) -> None:
    """Compiled and run by cloudless-run over its whole length: the parameters of a plain loop that
    steps the model file's own scheduler after each optimizer step. `--check` holds the rates."""
    path = model_file(with_scheduler(SCHEDULERS["warm-up then cosine"]))
    build = tmp_path / "build"
    code, _, err = compile_cli(str(path), "-o", str(build), "-q", "--repeats", "1", "--max-stages", "2")
    assert code == 0, err
    document = yaml.safe_load((build / "workflow.yaml").read_text())
    assert document["optimizer"]["learning_rates"] == torch_rates(path, 12)
    assert compile_cli("--check", str(build))[0] == 0
    assert run_main([str(build), "--out", str(tmp_path / "run"), "-q"]) == 0
    got = load_file(tmp_path / "run" / "model.safetensors")

    workflow = Workflow.from_json(document)
    loaded = load_model_file(path)
    trainer = PlainTrainer(
        loaded, workflow.run, region_items(loaded, workflow.regions[0]), OptimizerSpec("SGD"), workflow.run.iterations
    )
    assert loaded.make_scheduler is not None
    scheduler = loaded.make_scheduler(trainer.optimizer, workflow.run.iterations)
    for iteration in range(workflow.run.iterations):
        trainer.step(iteration)
        scheduler.step()
    for name, value in trainer.state().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # ... and not the parameters of the constant rate
    constant = PlainTrainer(
        loaded, workflow.run, region_items(loaded, workflow.regions[0]), OptimizerSpec("SGD"), workflow.run.iterations
    )
    for iteration in range(workflow.run.iterations):
        constant.step(iteration)
    assert any(not torch.allclose(got[k], v, rtol=1e-3, atol=1e-4) for k, v in constant.state().items())
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["test"]["loss"] > 0


def test_check_finds_rates_that_do_not_match_the_run(model_file, compile_cli, tmp_path: Path) -> None:
    path = model_file(with_scheduler(SCHEDULERS["steps"]))
    build = tmp_path / "build"
    assert compile_cli(str(path), "-o", str(build), "-q", "--repeats", "1", "--max-stages", "1")[0] == 0
    workflow = build / "workflow.yaml"
    document = yaml.safe_load(workflow.read_text())
    document["optimizer"]["learning_rates"] = document["optimizer"]["learning_rates"][:-1]
    workflow.write_text(yaml.safe_dump(document, sort_keys=False))
    code, _, err = compile_cli("--check", str(build))
    assert code == 2
    expected = "11 rates; expected one per iteration of run/iterations (12)"
    assert f"workflow.yaml: key optimizer/learning_rates: {expected}" in err


def test_a_bad_schedule_is_found_before_tracing(model_file, monkeypatch: pytest.MonkeyPatch) -> None:
    """The front end refuses it when it loads the model file, not after tracing, profiling and planning."""
    from cloudless.compiler import pipeline

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced before the schedule was checked")

    monkeypatch.setattr(pipeline, "trace_model", never)
    path = model_file(with_scheduler("torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)"))
    with pytest.raises(ModelFileError, match="ReduceLROnPlateau"):
        pipeline.run_front_end(pipeline.FrontEndOptions(model_path=path, profile_repeats=0))
