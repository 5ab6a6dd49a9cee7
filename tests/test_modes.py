"""Stage code follows train() and eval() as the model's modules do: the trace fixed training mode's literals
(batch norm with running statistics, dropout, rrelu; batch norm's batch count), and the stage reads
`self.training` there, so that a run's test figures are `model.eval()`'s."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import fx

from cloudless.codegen.stage_source import follow_modes
from cloudless.compiler.cli import main as compile_main
from cloudless.runtimes.cli import main as run_main

from .data_cases import EIGHT_FEATURES
from .runtime_cases import compile_pipeline

MODEL = (
    """
import torch
from torch import nn

TRAINING = {"global_batch_size": 16, "micro_batch_sizes": [4], "iterations": 6, "learning_rate": 0.05}


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3),
    )


"""
    + EIGHT_FEATURES
)


def test_training_literals_read_the_modules_mode_and_explicit_ones_stay() -> None:
    def forward(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        x = torch.ops.aten.batch_norm.default(x, None, None, mean, var, True, 0.1, 1e-5, False)
        x = torch.ops.aten.batch_norm.default(x, None, None, None, None, True, 0.1, 1e-5, False)  # no statistics
        x = torch.nn.functional.dropout(x, p=0.5, training=True)
        x = torch.nn.functional.dropout(x, p=0.5, training=False)  # the model's own choice
        return torch.nn.functional.rrelu(x, 0.1, 0.3, True)

    code = follow_modes(fx.symbolic_trace(forward).graph).python_code(root_module="self").src
    lines = [line.strip() for line in code.splitlines() if "=" in line and "(" in line]
    assert "mean, var, self.training, 0.1" in lines[0]
    assert "None, None, True, 0.1" in lines[1]
    assert "training = self.training" in lines[2] and "training = False" in lines[3]
    assert "training = self.training" in lines[4]


@pytest.mark.slow  # a compile and a run
def test_a_runs_test_figures_are_model_evals_in_a_pipeline_with_replicas(tmp_path: Path) -> None:
    model = tmp_path / "bn_dropout.py"
    build, _ = compile_pipeline(MODEL, model)
    stages = "\n".join(p.read_text() for p in build.glob("regions/*/functions/*/stage.py"))
    assert "training = True" not in stages and ", True, 0.1" not in stages
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(model), "-q"]) == 0
    test = json.loads((out / "metrics.json").read_text())["test"]

    sys.path.insert(0, str(tmp_path))
    try:
        import bn_dropout  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    plain = bn_dropout.build_model()
    plain.load_state_dict(load_file(out / "model.safetensors"))
    data = bn_dropout.load_shard("r", "test")
    figures = {}
    for mode in ("eval", "train"):
        getattr(plain, mode)()
        torch.manual_seed(0)
        losses, correct = [], 0
        with torch.no_grad():
            for first in range(0, len(data) - 3, 4):  # whole micro-batches of 4, in order
                x = torch.stack([data[i][0][0] for i in range(first, first + 4)])
                y = torch.stack([data[i][1] for i in range(first, first + 4)])
                output = plain(x)
                losses.append(float(bn_dropout.loss_fn(output, y)))
                correct += int((output.argmax(dim=1) == y).sum())
        figures[mode] = (sum(losses) / len(losses), correct / len(data))
    assert test["samples"] == 64
    assert test["loss"] == pytest.approx(figures["eval"][0], rel=1e-6, abs=1e-9)
    assert test["accuracy"] == figures["eval"][1]
    assert abs(figures["train"][0] - figures["eval"][0]) > 1e-3  # training mode's figures are others


BRANCHING = """
import torch
from torch import nn

TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [4], "iterations": 1}


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if self.training:  # the trace takes this branch, and the stage code keeps it in eval mode too
            x = x + 1.0
        return self.linear(x)


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Noisy(), nn.ReLU(), nn.Linear(4, 2))


def example_inputs(batch_size):
    return (torch.randn(batch_size, 4),)


def example_targets(batch_size):
    return torch.zeros(batch_size, dtype=torch.int64)


def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target)
"""


@pytest.mark.slow  # two compiles
def test_verify_compares_eval_mode_and_warns_of_a_branch_on_training_it_cannot_follow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, source, differs in (("follows.py", MODEL, False), ("branching.py", BRANCHING, True)):
        model = tmp_path / name
        model.write_text(textwrap.dedent(source))
        capsys.readouterr()
        assert compile_main([str(model), "-o", str(tmp_path / name.removesuffix(".py")), "--repeats", "1"]) == 0
        out, err = capsys.readouterr()
        verified = next(line for line in out.splitlines() if "verified" in line)
        assert ("eval-mode outputs 0 " in verified) is not differs, verified
        warned = [line for line in err.splitlines() if "in eval mode the stages' outputs differ" in line]
        assert len(warned) == int(differs), err
