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

from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.compiler.pipeline import balanced_stage_ranges
from cloudless.runtimes.cli import main as run_main
from tests.runtime_cases import front_end, reference_training, write_packages

from .conftest import MODELS, SAMPLES

TRACED = 2
MICRO_BATCH = 4
GLOBAL_BATCH = 8
ITERATIONS = 2

#: CI runs them all (and LARGE, below); the fast run trains pipelines with replicas in test_run.py and
#: test_higher_order.py
CASES = [
    # tied weights across stages, BatchNorm, dict output
    pytest.param(MODELS / "tricky.py", id="tricky", marks=pytest.mark.slow),
    pytest.param(MODELS / "loop.py", id="loop", marks=pytest.mark.slow),  # torch.export (fx cannot trace it)
    pytest.param(MODELS / "inplace.py", id="inplace", marks=pytest.mark.slow),  # in-place ops, BatchNorm buffers
    pytest.param(MODELS / "wide_mlp.py", id="wide_mlp", marks=pytest.mark.slow),
    pytest.param(MODELS / "hf_gpt2_tiny.py", id="hf_gpt2_tiny", marks=pytest.mark.slow),
    pytest.param(MODELS / "hf_bert_tiny.py", id="hf_bert_tiny", marks=pytest.mark.slow),
    pytest.param(
        MODELS / "hf_llama_tiny.py", id="hf_llama_tiny", marks=pytest.mark.slow
    ),  # a no_grad region, torch.export
    # encoder-decoder, three inputs, a cache object returned unless the compiler turns it off
    pytest.param(MODELS / "hf_t5_tiny.py", id="hf_t5_tiny", marks=pytest.mark.slow),
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

#: evaluating a large sample on its whole test split takes minutes here; its first few samples do
SHORT_TEST = """

def load_shard(region, split):
    shard = _model.load_shard(region, split)
    return torch.utils.data.Subset(shard, range({samples})) if split == "test" else shard
"""


def without_dropout(model: Path, folder: Path, test_samples: int | None = None) -> Path:
    """The model file with every nn.Dropout at p=0: the functions draw a stage's random numbers per
    (iteration, micro-batch, stage), a plain loop draws them in another order, so with dropout the
    two train differently (both correctly). --verify covers dropout: it chains the stages in order.
    `test_samples`: the test split cut to that many samples."""
    path = folder / f"{model.stem}_no_dropout.py"
    source = NO_DROPOUT.format(folder=str(model.parent), module=model.stem)
    if test_samples is not None:
        source += SHORT_TEST.format(samples=test_samples)
    path.write_text(source)
    return path


@pytest.mark.parametrize("model", CASES)
def test_a_replicated_pipeline_trains_like_plain_pytorch(model: Path, tmp_path: Path) -> None:
    trains_like_plain_pytorch(model, tmp_path, TRACED, MICRO_BATCH, GLOBAL_BATCH, ITERATIONS)


#: the large samples: one iteration of two micro-batches of 2 per replica (traced at 1), to keep CI short.
#: resnet101.py is resnet50.py's family with more blocks (the same code paths; it verifies in test_samples)
LARGE = [
    pytest.param(SAMPLES / name, id=name.removesuffix(".py"), marks=pytest.mark.slow)
    for name in ("gpt2.py", "bert_large.py", "resnet50.py")
]


@pytest.mark.parametrize("model", LARGE)
def test_a_large_sample_trains_like_plain_pytorch(model: Path, tmp_path: Path) -> None:
    trains_like_plain_pytorch(model, tmp_path, traced=1, micro_batch=2, global_batch=4, iterations=1, test_samples=4)


def trains_like_plain_pytorch(
    model: Path,
    tmp_path: Path,
    traced: int,
    micro_batch: int,
    global_batch: int,
    iterations: int,
    test_samples: int | None = None,
) -> None:
    """Two stages (the first x2) of `model` traced at `traced`, run for `iterations` at `micro_batch`,
    end with plain PyTorch's parameters."""
    model = without_dropout(model, tmp_path, test_samples)
    front = front_end(model, batch_size=traced)
    (first, cut), (after, last) = balanced_stage_ranges(front.chain, 2)
    build = tmp_path / "build"
    workflow = write_packages(
        front,
        build,
        [(first, cut, 2), (after, last, 1)],
        micro_batch=micro_batch,
        global_batch=global_batch,
        iterations=iterations,
    )
    assert [f.replicas for f in workflow.regions[0].functions] == [2, 1]
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(model), "-q"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and len(metrics["progress"]) == iterations
    params = load_file(out / "model.safetensors")
    # The user's model takes the file as it is: every key of its state_dict (a tied weight's each name).
    fresh = load_model_file(model).build_model()
    keys = set(fresh.state_dict())
    assert fresh.load_state_dict(params, strict=True)
    # On the functions' one thread: ResNet-50 at micro-batch 2 turns the float rounding of 2 threads'
    # convolutions into differences of 1% in conv1 after one step (plain PyTorch against itself).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = reference_training(front, workflow, workflow.regions[0].name)
    finally:
        torch.set_num_threads(threads)
    trainable = {name for name, _ in front.model.named_parameters(remove_duplicate=False)}
    # Running statistics of the replicated stage are the mean of its replicas' updates (data
    # parallelism), not plain PyTorch's updates one micro-batch after another.
    replicated = set(load_file(next(build.glob("regions/*/functions/*-s0/weights.safetensors"))))
    compared = 0
    for name, value in expected.items():
        if name not in params:  # the file has the model's state_dict keys: no non-persistent buffers
            assert name not in keys, name
            continue
        assert params[name].shape == value.shape, name
        if name not in trainable and name in replicated:
            assert not value.is_floating_point() or bool(params[name].isfinite().all()), name
            continue
        compared += 1
        torch.testing.assert_close(params[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert compared >= len(trainable & set(params))
