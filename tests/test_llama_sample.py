"""samples/llama_text.py: a transformers Llama trained on real text (Python's own pydoc topics, as
bytes). Fast: its data is deterministic, split cleanly and shaped as the run expects, and its loss
target means something (below what a model that ignores context can reach). Slow: compiled with
--verify into a 2-stage pipeline, it trains under `cloudless-run` to that target."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from collections import Counter
from importlib import resources
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml

from cloudless.ir.files import load_plan
from cloudless.runtimes.cli import main as run_main

from .conftest import SAMPLES

SAMPLE = SAMPLES / "llama_text.py"

#: the options that plan a pipeline for this machine (with `local_catalog`): the time objective,
#: one replica per stage and two functions at once (its two cores); the bench compiles the same
PIPELINE_OPTIONS = ("--objective", "time", "--replicas", "1", "--max-functions", "2")


def load_sample() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llama_text_sample", SAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_local_catalog(path: Path) -> Path:
    """The default catalog's first region as this machine runs it: 1-vCPU functions (one thread each,
    as `cloudless-run` gives them) and storage in a local folder (polled every 1-10 ms, so ~5 ms a
    request, and far faster than S3's 50-90 MB/s). With S3's figures a 0.66M-parameter model is not
    worth pipelining; with these, the time objective splits it."""
    catalog = yaml.safe_load(resources.files("cloudless.ir").joinpath("catalogs", "default.yaml").read_text())
    region = catalog["regions"][0]
    region["tiers_mb"] = [region["cpu"]["mb_per_vcpu"]]
    region["cpu"]["max_vcpus"] = 1
    region["limits"]["max_memory_mb"] = region["cpu"]["mb_per_vcpu"]
    region["network"] = {"min_mb_per_s": 200, "max_mb_per_s": 200, "request_latency_s": 0.005}
    catalog["regions"] = [region]
    path.write_text(yaml.safe_dump(catalog))
    return path


@pytest.fixture(scope="module")
def sample() -> ModuleType:
    return load_sample()


def entropies(previous: torch.Tensor, following: torch.Tensor) -> tuple[float, float]:
    """Unigram entropy of `following`, and its conditional entropy given `previous`, nats per byte."""
    counts = torch.bincount(following, minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    unigram = float(-(p * p.log()).sum())
    pairs = torch.bincount(previous * 256 + following, minlength=256 * 256).double().view(256, 256)
    joint = pairs / pairs.sum()
    conditional = joint / joint.sum(dim=1, keepdim=True).clamp_min(1e-300)
    seen = joint > 0
    return unigram, float(-(joint[seen] * conditional[seen].log()).sum())


def test_data_is_deterministic_split_and_shaped_for_the_run(sample: ModuleType) -> None:
    train, test = sample.load_shard("aws-us-east-1", "train"), sample.load_shard("aws-us-east-1", "test")
    # the same from a fresh import, in any region (the run fingerprints the data, and reuses it when unchanged)
    again = load_sample()
    assert torch.equal(again.load_shard("aws-eu-west-1", "train").windows, train.windows)
    assert torch.equal(again.load_shard("aws-us-east-1", "test").windows, test.windows)
    assert len(test) == int(sample.TEST_SHARE * (len(train) + len(test)))
    # a partition of the corpus's windows, re-cut here: CONTEXT + 1 bytes every CONTEXT bytes
    from pydoc_data.topics import topics

    corpus = "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")
    step, size = sample.CONTEXT, sample.CONTEXT + 1
    expected = Counter(corpus[i : i + size] for i in range(0, len(corpus) - size + 1, step))
    split = Counter(bytes(w.tolist()) for w in torch.cat([train.windows, test.windows]))
    assert split == expected

    (inputs,), target = train[5]
    assert inputs.shape == target.shape == (sample.CONTEXT,)
    assert inputs.dtype == target.dtype == torch.int64
    assert torch.equal(target[:-1], inputs[1:])  # the target is the next byte

    # the compile's example micro-batch is the first training samples
    assert torch.equal(sample.example_inputs(4)[0], train.windows[:4, :-1])
    assert torch.equal(sample.example_targets(4), train.windows[:4, 1:])


def test_loss_target_is_below_what_ignoring_context_reaches(sample: ModuleType) -> None:
    """A model that ignores its context can reach the unigram entropy at best, one that sees only the
    previous byte the bigram's conditional entropy (both on the training bytes themselves): the target
    asks for more than either."""
    windows = sample.load_shard("aws-us-east-1", "train").windows
    # every (input byte, target byte) pair the model is trained on
    unigram, bigram = entropies(windows[:, :-1].reshape(-1), windows[:, 1:].reshape(-1))
    assert 3.0 < unigram < math.log(sample.VOCAB_SIZE)
    assert sample.LOSS_TARGET < bigram < unigram


@pytest.mark.slow
def test_pipelined_build_trains_to_the_loss_target(compile_cli, tmp_path: Path) -> None:
    build = tmp_path / "build"
    catalog = write_local_catalog(tmp_path / "local.yaml")
    code, stdout, stderr = compile_cli(str(SAMPLE), "-o", str(build), "--verify", "-c", str(catalog), *PIPELINE_OPTIONS)
    assert code == 0, stderr
    plan = load_plan(build / "plan.json")
    assert len(plan.stages) == 2, stdout
    match = re.search(r"verified +2 stages.*largest gradient error (\S+)", stdout)
    assert match and float(match.group(1)) <= 1e-4, stdout

    out = tmp_path / "run"
    assert run_main([str(build), "--out", str(out), "-q"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    sample = load_sample()
    assert metrics["status"] == "done" and metrics["iterations"] == sample.TRAINING["iterations"]
    losses = [p["loss"] for p in metrics["progress"]]
    assert abs(losses[0] - math.log(sample.VOCAB_SIZE)) < 0.1  # it started from nothing: a uniform guess
    assert metrics["test"]["loss"] <= sample.LOSS_TARGET, metrics["test"]


@pytest.mark.slow
def test_the_lora_recipe_trains_its_adapter_in_a_pipeline_to_its_loss_target(compile_cli, tmp_path: Path) -> None:
    """samples/llama_lora.py: LoRA, parameter groups, warm-up + cosine, clipping and bf16 at once."""
    from peft import PeftModel

    sample_path = SAMPLES / "llama_lora.py"
    build = tmp_path / "build"
    catalog = write_local_catalog(tmp_path / "local.yaml")
    code, stdout, stderr = compile_cli(
        str(sample_path), "-o", str(build), "--verify", "-c", str(catalog), *PIPELINE_OPTIONS
    )
    assert code == 0, stderr
    assert len(load_plan(build / "plan.json").stages) == 2, stdout
    out = tmp_path / "run"
    assert run_main([str(build), "--out", str(out), "-q"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    spec = importlib.util.spec_from_file_location("llama_lora_sample", sample_path)
    assert spec is not None and spec.loader is not None
    lora = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lora)
    losses = [p["loss"] for p in metrics["progress"]]
    assert metrics["status"] == "done" and len(losses) == lora.TRAINING["iterations"]
    assert metrics["test"]["loss"] <= lora.LOSS_TARGET < losses[0], metrics["test"]
    # the whole model loads strictly; the adapter as peft saved it, onto a fresh base model
    from safetensors.torch import load_file

    trained = load_file(out / "model.safetensors")
    model = lora.build_model()
    model.load_state_dict(trained, strict=True)
    loaded = PeftModel.from_pretrained(lora.build_model().unload(), out / "adapter")
    for name, value in loaded.state_dict().items():
        if "lora_" in name or "modules_to_save" in name:
            assert torch.equal(value, trained[name]), name
