"""Optimizers outside torch.optim run in the functions: transformers' Adafactor (an installed package's) and a
Lion the model file defines train as the plain loop does in a 2-stage x 2-replica pipeline, under a schedule,
and a run resumed from a checkpoint ends with the same bits as one that never stopped."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.ir.protocol import namespace, state_key
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as run_main

from .data_cases import EIGHT_FEATURES
from .reference import plain_training
from .runtime_cases import compile_pipeline

MODEL = (
    """
import torch
from torch import nn

TRAINING = {"global_batch_size": 16, "micro_batch_sizes": [4], "iterations": 6}


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def make_scheduler(optimizer, iterations):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
"""
    + EIGHT_FEATURES
)

ADAFACTOR = """
from transformers.optimization import Adafactor


def make_optimizer(params):
    return Adafactor(params, lr=0.01, relative_step=False, scale_parameter=False, warmup_init=False, beta1=0.9)
"""

LION = '''
class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): the sign of an interpolated momentum."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = state["exp_avg"] * beta1 + p.grad * (1 - beta1)
                p.add_(update.sign(), alpha=-group["lr"])
                state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)


def make_optimizer(params):
    return Lion(params, lr=3e-3, weight_decay=0.1)
'''

RUN = "whole"


def _build(tmp_path: Path, name: str, optimizer: str) -> tuple[Path, Path, Workflow]:
    model = tmp_path / f"{name}.py"
    build, workflow = compile_pipeline(textwrap.dedent(MODEL) + textwrap.dedent(optimizer), model)
    return model, build, workflow


def _assert_trains_as_the_plain_loop(model: Path, workflow: Workflow, trained: dict[str, torch.Tensor]) -> None:
    expected = plain_training(load_model_file(model), workflow, workflow.regions[0].name)
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert any(
        not torch.equal(value, load_model_file(model).build_model().state_dict()[name])
        for name, value in trained.items()
    )


@pytest.mark.slow  # a compile and three runs
def test_adafactor_trains_as_the_plain_loop_and_resumes_exactly(tmp_path: Path, capsys) -> None:
    model, build, workflow = _build(tmp_path, "adafactor_mlp", ADAFACTOR)
    assert (workflow.optimizer.class_name, workflow.optimizer.module) == ("Adafactor", "transformers.optimization")
    assert workflow.optimizer.learning_rates == (0.01, 0.01, 0.005, 0.005, 0.0025, 0.0025)
    requirements = (build / workflow.regions[0].functions[0].package / "requirements-libraries.txt").read_text()
    assert "transformers==" in requirements
    storage = tmp_path / "storage"
    argv = [str(build), "--storage", str(storage), "--model", str(model), "-q"]
    assert run_main([*argv, "--out", str(tmp_path / "out"), "--run-id", RUN, "--keep-storage"]) == 0
    whole = load_file(tmp_path / "out" / "model.safetensors")
    _assert_trains_as_the_plain_loop(model, workflow, whole)

    # the run stopped after its checkpoint at iteration 4: resumed, it ends with the same bits
    space = namespace(RUN, workflow.regions[0].name)
    assert workflow.run.checkpoint_every == 2
    for function in workflow.regions[0].functions:
        (storage / state_key(space, function.stage, workflow.run.iterations)).unlink()
    capsys.readouterr()
    assert run_main([*argv, "--out", str(tmp_path / "resumed"), "--resume", RUN]) == 0
    assert "resuming run whole from iteration 4" in capsys.readouterr().out
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(resumed[name], whole[name]) for name in whole)


@pytest.mark.slow  # a compile and a run
def test_an_optimizer_the_model_file_defines_trains_as_the_plain_loop(tmp_path: Path) -> None:
    model, build, workflow = _build(tmp_path, "lion_mlp", LION)
    assert (workflow.optimizer.class_name, workflow.optimizer.module) == ("Lion", "cloudless_user_file_lion_mlp")
    assert dict(workflow.optimizer.options) == {"betas": [0.9, 0.99], "lr": 0.003, "weight_decay": 0.1}
    assert (build / workflow.regions[0].functions[1].package / "user" / "lion_mlp.py").is_file()
    assert run_main([str(build), "--out", str(tmp_path / "out"), "--model", str(model), "-q"]) == 0
    _assert_trains_as_the_plain_loop(model, workflow, load_file(tmp_path / "out" / "model.safetensors"))


def test_an_optimizer_class_made_inside_a_function_is_one_line(model_file, compile_cli, tmp_path) -> None:
    path = model_file(
        textwrap.dedent(MODEL)
        + "\n\ndef make_optimizer(params):\n"
        + "    class Local(torch.optim.SGD):\n        pass\n\n    return Local(params, lr=0.1)\n"
    )
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"), "--repeats", "1")
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert f"{path}: make_optimizer returned make_optimizer.<locals>.Local, a class made inside a function" in stderr
    assert not (tmp_path / "b").exists()
