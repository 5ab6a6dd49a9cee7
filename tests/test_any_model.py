"""Every test model and the small sample, split into a pipeline whose first stage is replicated and run at a
micro-batch other than the traced one, trains under `cloudless-run` to plain PyTorch's parameters.

`--verify` compares one forward and backward of the stages with the model; this compares what a user
gets: whole iterations through the generated packages, storage, the scatter-reduce and the optimizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cloudless.compiler.pipeline import balanced_stage_ranges
from cloudless.runtimes.run import main as run_main
from tests.runtime_cases import front_end, reference_training, write_packages

from .conftest import MODELS, SAMPLES

TRACED = 2
MICRO_BATCH = 4
GLOBAL_BATCH = 8
ITERATIONS = 2

#: the fast run keeps the awkward small model and the export one; CI runs them all. The large samples
#: (GPT-2, BERT-Large, ResNet-50/101) verify in tests/test_samples.py; training them here takes too long.
CASES = [
    pytest.param(MODELS / "tricky.py", id="tricky"),  # tied weights across stages, BatchNorm, dict output
    pytest.param(MODELS / "loop.py", id="loop"),  # torch.export (fx cannot trace it)
    pytest.param(MODELS / "inplace.py", id="inplace", marks=pytest.mark.slow),  # in-place ops, BatchNorm buffers
    pytest.param(MODELS / "wide_mlp.py", id="wide_mlp", marks=pytest.mark.slow),
    pytest.param(MODELS / "hf_gpt2_tiny.py", id="hf_gpt2_tiny", marks=pytest.mark.slow),
    pytest.param(MODELS / "hf_bert_tiny.py", id="hf_bert_tiny", marks=pytest.mark.slow),
    pytest.param(
        MODELS / "hf_llama_tiny.py", id="hf_llama_tiny", marks=pytest.mark.slow
    ),  # a no_grad region, torch.export
    pytest.param(SAMPLES / "mlp_digits.py", id="mlp_digits", marks=pytest.mark.slow),
]


NO_DROPOUT = """\
import sys

import torch

sys.path.insert(0, {folder!r})
import {module} as _model

for _name in ("TRAINING", "example_inputs", "example_targets", "loss_fn", "make_optimizer", "load_shard"):
    if hasattr(_model, _name):
        globals()[_name] = getattr(_model, _name)


def build_model() -> torch.nn.Module:
    model = _model.build_model()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model
"""


def without_dropout(model: Path, folder: Path) -> Path:
    """The model file with every nn.Dropout at p=0: the functions draw a stage's random numbers per
    (iteration, micro-batch, stage), a plain loop draws them in another order, so with dropout the
    two train differently (both correctly). --verify covers dropout: it chains the stages in order."""
    path = folder / f"{model.stem}_no_dropout.py"
    path.write_text(NO_DROPOUT.format(folder=str(model.parent), module=model.stem))
    return path


@pytest.mark.parametrize("model", CASES)
def test_a_replicated_pipeline_trains_like_plain_pytorch(model: Path, tmp_path: Path) -> None:
    model = without_dropout(model, tmp_path)
    front = front_end(model, batch_size=TRACED)
    (first, cut), (after, last) = balanced_stage_ranges(front.chain, 2)
    build = tmp_path / "build"
    workflow = write_packages(
        front,
        build,
        [(first, cut, 2), (after, last, 1)],
        micro_batch=MICRO_BATCH,
        global_batch=GLOBAL_BATCH,
        iterations=ITERATIONS,
    )
    assert [f.replicas for f in workflow.regions[0].functions] == [2, 1]
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(model), "-q"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and len(metrics["progress"]) == ITERATIONS
    params = load_file(out / "model.safetensors")
    expected = reference_training(front, workflow, workflow.regions[0].name)
    trainable = {name for name, _ in front.model.named_parameters(remove_duplicate=False)}
    # Running statistics of the replicated stage are the mean of its replicas' updates (data
    # parallelism), not plain PyTorch's updates one micro-batch after another.
    replicated = set(load_file(next(build.glob("regions/*/functions/*-s0/weights.safetensors"))))
    compared = 0
    for name, value in expected.items():
        if name not in params:
            # a tied weight's second name: the run saves each tensor once, under the model's first name
            same = [n for n, p in params.items() if p.shape == value.shape and torch.allclose(p, value, 1e-4, 1e-5)]
            assert name in trainable and same, name
            continue
        assert params[name].shape == value.shape, name
        if name not in trainable and name in replicated:
            assert not value.is_floating_point() or bool(params[name].isfinite().all()), name
            continue
        compared += 1
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert compared >= len(trainable & set(params))
