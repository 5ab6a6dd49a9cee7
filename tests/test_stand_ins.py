"""Plan from shapes: stand-ins for the weights give the graph, blocks and plan the weights give, with
one block's weights in memory at a time."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from cloudless.compiler.frontend.stand_ins import (
    is_stand_in,
    materialised,
    parameters_on_meta,
    replace_with_stand_ins,
    run_blocks_one_by_one,
)
from cloudless.compiler.pipeline import FrontEndOptions, run_front_end

ROOT = Path(__file__).resolve().parent.parent

#: what a front end must keep apart: a tied weight, a buffer, a module called twice, a frozen
#: parameter, a skip connection, an integer input
SHAPES_MODEL = """
    import torch
    from torch import nn

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 4}


    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU())
            self.frozen = nn.Linear(16, 16)
            self.frozen.requires_grad_(False)
            self.norm = nn.LayerNorm(16)
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

        def forward(self, ids):
            x = self.embed(ids)
            h = self.block(x) * self.scale
            h = self.block(h) + x
            return self.head(self.norm(self.frozen(h)))


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return Net()


    def example_inputs(batch_size: int):
        return (torch.randint(0, 50, (batch_size, 6), generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, 50, (batch_size, 6), generator=torch.Generator().manual_seed(1))


    def loss_fn(output, target):
        return nn.functional.cross_entropy(output.reshape(-1, 50), target.reshape(-1))
"""


@pytest.mark.parametrize("model", ["shapes", "samples/llama_text.py"])
def test_stand_ins_give_the_graph_and_blocks_the_weights_give(tmp_path: Path, model: str) -> None:
    if model == "shapes":
        path = tmp_path / "model.py"
        path.write_text(textwrap.dedent(SHAPES_MODEL))
    else:
        path = ROOT / model
    fronts = [run_front_end(FrontEndOptions(path, profile_repeats=0, stand_ins=s)) for s in (False, True)]
    weights, shapes = fronts
    assert not any(is_stand_in(p) for p in weights.model.parameters())
    assert all(is_stand_in(p) or p.numel() <= 1 for p in shapes.model.parameters())
    assert json.dumps(shapes.graph.to_json()) == json.dumps(weights.graph.to_json())
    assert json.dumps(shapes.chain.to_json()) == json.dumps(weights.chain.to_json())
    # the stand-ins hold one element each; the buffers keep their values
    assert all(p.untyped_storage().nbytes() <= p.element_size() for p in shapes.model.parameters())
    for (name, a), (_, b) in zip(weights.model.named_buffers(), shapes.model.named_buffers(), strict=True):
        assert torch.equal(a, b), name


def test_a_model_built_with_stand_ins_keeps_ties_and_frozen_flags() -> None:
    with parameters_on_meta():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight
    model[1].bias.requires_grad_(False)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert replace_with_stand_ins(model) == (10 * 4 + 10) * 4  # the tied weight once
    assert model[1].weight is model[0].weight and is_stand_in(model[0].weight)
    assert not model[1].bias.requires_grad and model[0].weight.requires_grad
    assert nn.Linear(3, 3).weight.device.type == "cpu"  # the context closed


def test_the_profile_times_a_block_at_a_time_with_its_weights_and_identical_blocks_once() -> None:
    layers = [nn.Linear(8, 8) for _ in range(3)]
    head = nn.Linear(8, 2)
    for layer in [*layers, head]:
        for name, p in list(layer._parameters.items()):
            layer._parameters[name] = nn.Parameter(torch.zeros(1).expand(p.shape))
    seen: list[tuple[int, list[bool]]] = []

    def stage(index: int, module: nn.Module):
        def run(x):
            seen.append((index, [is_stand_in(p) for m in [*layers, head] for p in m.parameters()]))
            return (module(x),)

        return run

    stages = [stage(i, m) for i, m in enumerate([*layers, head])]
    signatures = [(["x"], ["h"]), (["h"], ["h2"]), (["h2"], ["h3"]), (["h3"], ["out"])]
    params = [list(m.parameters()) for m in [*layers, head]]
    forward, backward = run_blocks_one_by_one(
        stages, signatures, params, ["layer", "layer", "layer", "head"], {"x": torch.randn(4, 8)},
        lambda outputs: outputs[0].sum(),
    )  # fmt: skip
    # the first layer and the head ran, each with only its own weights made; the identical layers did not
    assert [index for index, _ in seen] == [0, 3]
    assert seen[0][1] == [False, False] + [True] * 6 and seen[1][1] == [True] * 6 + [False, False]
    assert forward[0] == forward[1] == forward[2] and backward[0] == backward[1] == backward[2]
    assert all(is_stand_in(p) and p.grad is None for m in [*layers, head] for p in m.parameters())


def test_materialised_puts_the_stand_ins_back_even_after_an_error() -> None:
    param = nn.Parameter(torch.zeros(1).expand(3, 3))
    with pytest.raises(RuntimeError, match="boom"), materialised([param, param]):
        assert not is_stand_in(param) and param.shape == (3, 3)
        raise RuntimeError("boom")
    assert is_stand_in(param)


def test_plan_only_writes_the_plan_a_full_compile_makes(compile_cli, tmp_path: Path) -> None:
    full, planned = tmp_path / "full", tmp_path / "planned"
    model = str(ROOT / "samples" / "mlp_digits.py")
    code, _, err = compile_cli(model, "-o", str(full), "-q", "--stages", "2", "--no-verify")
    assert code == 0, err
    profile = str(full / "ir" / "blocks.json")
    code, _, err = compile_cli(model, "-o", str(planned), "-q", "--stages", "2", "--plan-only", "--profile", profile)
    assert code == 0, err
    assert sorted(p.name for p in planned.iterdir()) == ["cloudless-build.json", "ir", "plan.json"]
    assert (planned / "plan.json").read_bytes() == (full / "plan.json").read_bytes()
    assert (planned / "ir" / "graph.json").read_bytes() == (full / "ir" / "graph.json").read_bytes()
    code, _, err = compile_cli(model, "-o", str(tmp_path / "x"), "--plan-only", "--verify")
    assert code == 2 and "--plan-only cannot go with --verify" in err
    assert not (tmp_path / "x").exists()


WIDE = """
    import torch
    from torch import nn

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 10}


    def build_model() -> nn.Module:
        return nn.Sequential(*[nn.Sequential(nn.Linear(4096, 4096), nn.ReLU()) for _ in range(16)], nn.Linear(4096, 10))


    def example_inputs(batch_size: int):
        return (torch.randn(batch_size, 4096),)


    def example_targets(batch_size: int):
        return torch.randint(0, 10, (batch_size,))
"""


@pytest.mark.slow
def test_plan_only_holds_one_block_of_a_model_bigger_than_its_peak_memory(tmp_path: Path) -> None:
    """1.07 GB of weights (16 layers of 64 MiB); planned from shapes, the compiling process peaks below
    the weights' size (a compile with the weights peaks at several times it)."""
    path = tmp_path / "wide.py"
    path.write_text(textwrap.dedent(WIDE))
    # the compiling process reports its own peak: VmHWM, its memory's high-water mark since exec (the
    # rusage figures count other tests' children, or what a child inherited from its parent at fork)
    runner = (
        "import sys\nfrom cloudless.compiler.cli import main\ncode = main(sys.argv[1:])\n"
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print('MAXRSS', int(hwm.split()[1]) * 1024)\nsys.exit(code)\n"
    )
    command = [sys.executable, "-c", runner, str(path), "-o", str(tmp_path / "b")]
    result = subprocess.run([*command, "-q", "--plan-only", "--repeats", "2"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    peak = next(int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("MAXRSS"))
    weights = (16 * (4096 * 4096 + 4096) + 4096 * 10 + 10) * 4
    assert peak < weights, (peak, weights)
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["predicted"]["iteration_s"] > 0
