"""Buffers the forward changes, under replicas: batch norm's running statistics and counters end each iteration
as the plain loop's sequence of micro-batches leaves them (a position-weighted reduce), and a buffer whose
order replicas cannot reproduce keeps its stage at one replica, or, with --replicas excluding one, is one
line naming it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cloudless.compiler.cli import main as compile_main
from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.function.buffer_updates import BufferUpdates

from .data_cases import EIGHT_FEATURES
from .reference import plain_training
from .runtime_cases import compile_pipeline

BATCH_NORM = (
    """
import torch
from torch import nn

TRAINING = {"global_batch_size": 16, "micro_batch_sizes": [4], "iterations": 5, "learning_rate": 0.05}


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(),
        nn.Linear(16, 16), nn.BatchNorm1d(16, momentum=0.3), nn.ReLU(), nn.Linear(16, 3),
    )


"""
    + EIGHT_FEATURES
)

#: a centring average the forward reads (and a step counter): its result depends on the micro-batches' order
MOVING_CENTRE = """
class Centre(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.register_buffer("ema", torch.zeros(n))
        self.register_buffer("steps", torch.tensor(0))

    def forward(self, x):
        self.ema.mul_(0.9).add_(0.1 * x.mean(0).detach())
        self.steps += 1
        return x - self.ema


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), Centre(16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
"""


def test_the_parts_of_replicas_sum_to_the_sequence_of_updates() -> None:
    """Two replicas' parts (micro-batches 0, 2, 4 and 1, 3, 5 from the same start) against one sequence."""
    stats = [torch.randn(5) for _ in range(6)]
    norm = torch.nn.BatchNorm1d(5, momentum=0.2)
    norm.running_mean.uniform_()
    start = {k: v.clone() for k, v in norm.state_dict().items()}
    plain = torch.nn.BatchNorm1d(5, momentum=0.2)
    plain.load_state_dict(start)
    for s in stats:
        plain(s.reshape(1, 5).repeat(2, 1) + torch.tensor([[1.0], [-1.0]]))
    rules = {"running_mean": ("average", 0.2), "running_var": ("average", 0.2), "num_batches_tracked": ("count", None)}
    summed: list[torch.Tensor] | None = None
    replicas = []
    for replica in range(2):
        norm = torch.nn.BatchNorm1d(5, momentum=0.2)
        norm.load_state_dict(start)
        updates = BufferUpdates(norm, rules)
        updates.begin(len(stats))
        for m in range(replica, len(stats), 2):
            updates.before_forward()
            norm(stats[m].reshape(1, 5).repeat(2, 1) + torch.tensor([[1.0], [-1.0]]))
            updates.after_forward(m)
        parts = updates.parts()
        summed = parts if summed is None else [a + b for a, b in zip(summed, parts, strict=True)]
        replicas.append((norm, updates))
    assert summed is not None
    for norm, updates in replicas:
        updates.adopt(summed)
        torch.testing.assert_close(norm.running_mean, plain.running_mean, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(norm.running_var, plain.running_var, rtol=1e-6, atol=1e-7)
        assert int(norm.num_batches_tracked) == int(plain.num_batches_tracked) == 6


@pytest.mark.slow  # a compile and a run
def test_batch_norm_statistics_and_counts_under_replicas_equal_the_plain_loops(tmp_path: Path) -> None:
    model = tmp_path / "bn_replicas.py"
    build, workflow = compile_pipeline(BATCH_NORM, model)
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(model), "-q"]) == 0
    trained = load_file(out / "model.safetensors")
    expected = plain_training(load_model_file(model), workflow, workflow.regions[0].name)
    assert int(expected["1.num_batches_tracked"]) == 5 * 4  # iterations x micro-batches
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_buffer_changed_in_sequence_keeps_its_stage_at_one_replica_or_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = textwrap.dedent(BATCH_NORM)
    start, end = source.index("def build_model"), source.index("def example_inputs")
    model = tmp_path / "centred.py"
    model.write_text(source[:start] + textwrap.dedent(MOVING_CENTRE).lstrip() + "\n\n" + source[end:])
    plan = ["--stages", "2", "--repeats", "1", "--plan-only", "-q"]
    assert compile_main([str(model), "-o", str(tmp_path / "forced"), *plan, "--replicas", "2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "changes buffer 1.ema in place" in line and "include 1 (e.g. --replicas 1,2)" in line, line

    assert compile_main([str(model), "-o", str(tmp_path / "planned"), *plan, "--replicas", "1,2"]) == 0
    blocks = yaml.safe_load((tmp_path / "planned" / "ir" / "blocks.json").read_text())
    assert blocks["sequenced"] == ["1.ema", "1.steps"]
    holding = {b["index"] for b in blocks["blocks"] if {"1.ema", "1.steps"} & set(b["params"])}
    stages = yaml.safe_load((tmp_path / "planned" / "plan.json").read_text())["stages"]
    spans = [(set(range(s["blocks"][0], s["blocks"][1] + 1)), s["replicas"]) for s in stages]
    assert holding and all(replicas == 1 for blocks_of, replicas in spans if holding & blocks_of), stages
