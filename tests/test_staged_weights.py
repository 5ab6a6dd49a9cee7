"""A staged build (`--weights staged`, or a model beyond the threshold): the build holds no parameter
weights, the run stages each stage's from build_model() one stage at a time, each function loads its
own, and the values are exactly build_model()'s."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from cloudless.compiler.pipeline import FrontEndOptions, balanced_stage_ranges, run_front_end
from cloudless.runtimes.control.staged_weights import parameters_in_files
from cloudless.runtimes.function.initial_weights import package_weights
from cloudless.runtimes.storage.channels import DirectoryChannel
from tests.runtime_cases import write_packages


class Tied(nn.Module):
    """A tied weight, a buffer, a parameter initialised after it is registered, one set by assignment."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(16))
        self.gain = nn.Parameter(torch.empty(16))
        nn.init.normal_(self.gain)
        with torch.no_grad():
            self.body[0].weight.mul_(2.0)


def test_a_model_built_with_its_parameters_in_files_has_build_models_values_and_ties(tmp_path: Path) -> None:
    torch.manual_seed(3)
    plain = Tied()
    torch.manual_seed(3)
    with parameters_in_files(tmp_path) as files:
        held = Tied()
    assert held.head.weight is held.embed.weight
    assert all(files.holds(p) for p in held.parameters())
    assert not files.holds(held.scale)  # buffers stay in memory
    for (name, value), (_, expected) in zip(held.state_dict().items(), plain.state_dict().items(), strict=True):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)
    # the files hold what was written, after the pages were dropped from the process
    files.sweep()
    torch.testing.assert_close(held.body[0].weight, plain.body[0].weight, rtol=0, atol=0)
    # a parameter registered after the context closed is an ordinary one
    held.extra = nn.Parameter(torch.ones(3))
    assert not files.holds(held.extra)


def test_a_transformers_model_built_with_its_parameters_in_files_initialises_as_usual(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(5)
    plain = transformers.LlamaForCausalLM(config)
    torch.manual_seed(5)
    with parameters_in_files(tmp_path):
        held = transformers.LlamaForCausalLM(config)
    assert held.lm_head.weight is held.model.embed_tokens.weight
    for (name, value), (_, expected) in zip(held.state_dict().items(), plain.state_dict().items(), strict=True):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)


WIDE = """
    import torch
    from torch import nn

    LAYERS, WIDTH = 16, 2048


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH), nn.Tanh())
                               for _ in range(LAYERS // 2)], nn.Linear(WIDTH, 4))


    def example_inputs(batch_size: int):
        return (torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, 4, (batch_size,), generator=torch.Generator().manual_seed(1))


    def loss_fn(output, target):
        return nn.functional.cross_entropy(output, target)


    def load_shard(region: str, split: str):
        return torch.utils.data.TensorDataset(example_inputs(8)[0], example_targets(8))
"""

#: the staging process: stages a build's weights into a folder and prints its memory's growth (VmHWM, its
#: high-water mark since exec, after its imports, less the same before the model is built)
STAGER = """
import json, sys, yaml
from pathlib import Path
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.control.staged_weights import stage_weights
from cloudless.runtimes.control.staging import load_model_module
from cloudless.runtimes.storage.channels import DirectoryChannel

def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))

build, model, storage = map(Path, sys.argv[1:4])
workflow = Workflow.from_json(yaml.safe_load((build / "workflow.yaml").read_text()))
module = load_model_module(model)
before = hwm()
done = stage_weights(module, workflow.regions, {r.name: (DirectoryChannel(storage), "run/r") for r in workflow.regions})
print(json.dumps({"growth": hwm() - before, "bytes": done.bytes, "functions": done.functions}))
"""


@pytest.mark.slow
def test_staging_holds_one_stage_at_a_time_and_each_function_loads_only_its_own(tmp_path: Path) -> None:
    """512 MiB of weights in 8 stages: the staging process grows by less than half the model (a stage is
    an eighth: its mapped pages, its serialised bytes and their sealed copy), the build holds none of
    them, and each function's initial weights are its stage's, exactly build_model()'s."""
    path = tmp_path / "wide.py"
    path.write_text(textwrap.dedent(WIDE))
    front = run_front_end(FrontEndOptions(path, profile_repeats=0, stand_ins=True))
    ranges = balanced_stage_ranges(front.chain, 8)
    build = tmp_path / "build"
    workflow = write_packages(
        front, build, [(first, last, 1) for first, last in ranges], micro_batch=2, global_batch=4, iterations=1
    )
    model_bytes = sum(p.numel() * 4 for p in front.model.parameters())
    assert model_bytes > 500 * 2**20
    build_bytes = sum(f.stat().st_size for f in build.rglob("*") if f.is_file())
    assert build_bytes < model_bytes / 50, build_bytes
    storage = tmp_path / "storage"
    result = subprocess.run(
        [sys.executable, "-c", STAGER, str(build), str(path), str(storage)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    staged = json.loads(result.stdout.splitlines()[-1])
    assert staged["functions"] == 8
    assert staged["bytes"] >= model_bytes
    assert staged["growth"] < model_bytes / 2, (staged, model_bytes)
    namespace = {"__name__": "wide"}
    exec(textwrap.dedent(WIDE), namespace)
    expected = namespace["build_model"]().state_dict()
    channel = DirectoryChannel(storage)
    seen: set[str] = set()
    for function in workflow.regions[0].functions:
        with safe_open(build / function.package / "weights.safetensors", "pt") as weights:
            assert not set(weights.keys()) & {name for name, _ in function.staged_parameters}
        initial = package_weights(build / function.package, function, channel, "run/r", 5)
        assert set(initial) == {name for name, _ in function.staged_parameters}
        for name, source in function.staged_parameters:
            torch.testing.assert_close(initial[name], expected[source], rtol=0, atol=0, msg=name)
            seen.add(source)
    assert seen == set(expected)


@pytest.mark.slow
def test_a_staged_build_trains_through_the_deploy_driver_as_plain_pytorch(tmp_path: Path, capsys) -> None:
    """Compiled with --weights staged (no parameter in any package), rehearsed on the deploy path: the
    driver stages each stage's parameters into the stack's bucket, each Lambda loads its own, and the
    trained model comes back in shards that hold plain PyTorch's parameters."""
    from cloudless.compiler.cli import main as compile_main
    from cloudless.compiler.frontend.model_file import load_model_file
    from cloudless.ir.workflow import Workflow
    from cloudless.runtimes.cli import main as run_main
    from tests.reference import plain_training
    from tests.runtime_cases import MLP

    build, out = tmp_path / "build", tmp_path / "out"
    assert compile_main([str(MLP), "-o", str(build), "--weights", "staged", "--stages", "2", "-q"]) == 0
    capsys.readouterr()
    workflow = Workflow.from_json(yaml.safe_load((build / "workflow.yaml").read_text()))
    region = workflow.regions[0]
    assert all(f.staged_parameters for f in region.functions)
    code = run_main([str(build), "--invoker", "lambda", "--rehearse", "--iterations", "6", "--out", str(out),
                     "--model", str(MLP)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "weights: 2 stages' parameters staged from build_model()" in captured.out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    trained: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        trained.update(load_file(out / shard))
    expected = plain_training(load_model_file(MLP), workflow, region.name, iterations=6)
    assert set(trained) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
