"""Higher-order ops torch.export emits: grad-mode and autocast regions become sub-graph modules of the
generated stage that run under `with torch.set_grad_enabled(...)` / `with torch.autocast(...)`; control
flow is refused at compile time naming the model's line and module; every stage a compile writes is
loaded first, so one that cannot load is a compile error, never a function's failure at run time."""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cloudless.codegen.stage_source import StageHeader, render_stage_source
from cloudless.compiler.errors import CompileError, VerificationError
from cloudless.compiler.frontend.trace import export_module
from cloudless.compiler.frontend.verify import check_stage_loads, load_stage, verify_stages
from cloudless.compiler.pipeline import (
    Compiled,
    CompileOptions,
    FrontEnd,
    FrontEndOptions,
    compile_model,
    generate_stages,
    run_front_end,
)
from cloudless.runtimes.cli import main as run_main
from tests.runtime_cases import reference_training, write_packages

from .conftest import MODELS

LLAMA = MODELS / "hf_llama_tiny.py"

_CONTRACT = """
    import torch
    from torch import nn


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return Model()


    def example_inputs(batch_size: int):
        return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, 4, (batch_size,), generator=torch.Generator().manual_seed(1))

"""

#: the layers of the models below, whose forward holds the region
_THREE_LAYERS = """
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 16)
            self.c = nn.Linear(16, 4)
"""

NO_GRAD = (
    _THREE_LAYERS
    + """

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            with torch.no_grad():
                # a stop-gradient through parameters: no gradient may flow through it
                scale = self.b(h).abs().mean() + self.a.weight.norm()
            return self.c(torch.relu(self.b(h)) / scale)
"""
)

AUTOCAST = (
    _THREE_LAYERS
    + """

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                g = torch.relu(self.b(h))
            return self.c(g.float() + h)
"""
)

#: activation checkpointing (torch.utils.checkpoint) around a layer, and a grad-enabled region inside
#: a stop-gradient one
CHECKPOINTED = (
    _THREE_LAYERS
    + """

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            g = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.b(t)), h, use_reentrant=False)
            with torch.no_grad():
                with torch.enable_grad():
                    gate = torch.sigmoid(self.b(h))
                scale = self.a.weight.norm()
            return self.c(g * gate / scale)
"""
)

#: a region inside a region: the sub-graph holds a sub-graph of its own
NESTED = (
    _THREE_LAYERS
    + """

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            with torch.no_grad():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    scale = self.b(h).abs().mean()
                scale = scale.float() + self.a.weight.norm()
            return self.c(torch.relu(self.b(h)) / scale)
"""
)

#: torch.export (2.13) drops the no_grad region inside the autocast one
NO_GRAD_IN_AUTOCAST = (
    _THREE_LAYERS
    + """

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = torch.tanh(self.a(x))
                with torch.no_grad():
                    scale = self.b(h).abs().mean() + 1
            return self.c(h.float() / scale.float())
"""
)

#: the region inside a module named with --leaf-module: inlined from the leaf's own export
LEAF = """
    class Normalise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Linear(16, 16)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                scale = self.b(h).abs().mean() + 1
            return torch.relu(self.b(h)) / scale


    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.norm = Normalise()
            self.c = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.norm(torch.tanh(self.a(x))))
"""


def write_model(folder: Path, body: str, name: str = "model.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(_CONTRACT) + textwrap.dedent(body))
    return path


def verified(path: Path, stages: int, **options) -> Compiled:
    options.setdefault("profile_repeats", 0)
    return compile_model(CompileOptions(FrontEndOptions(path, **options), verify_stages=stages))


def region_stage(result: Compiled, text: str) -> int:
    """The index of the stage whose source holds `text`."""
    holding = [s.index for s in result.stages if text in s.source]
    assert len(holding) == 1, [s.source for s in result.stages]
    return holding[0]


# --- regions between two runs of blocks, as a transformer's rotary embedding sits ----------------

#: a stop-gradient through a parameter the model also trains, a grad-enabled region inside it, and an
#: autocast region, between two runs of blocks: the regions fall in a middle stage of a pipeline
DEEP = """
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + torch.tanh(self.lin(h))


    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.first = nn.ModuleList(Block() for _ in range(3))
            self.gate = nn.Linear(16, 16)
            self.second = nn.ModuleList(Block() for _ in range(3))
            self.c = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            for block in self.first:
                h = block(h)
            with torch.no_grad():
                scale = self.gate(h).abs().mean() + self.a.weight.norm()
                with torch.enable_grad():
                    g = torch.sigmoid(self.gate(h))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                m = self.gate(h * g)
            h = h + m.float() / scale
            for block in self.second:
                h = block(h)
            return self.c(h)


    class Rows(torch.utils.data.Dataset):
        def __init__(self, count: int) -> None:
            self.inputs, self.targets = example_inputs(count), example_targets(count)

        def __len__(self) -> int:
            return len(self.targets)

        def __getitem__(self, i: int):
            return (self.inputs[0][i],), self.targets[i]


    def load_shard(region: str, split: str) -> Rows:
        return Rows(32 if split == "train" else 8)
"""

#: the parameters of DEEP: a, gate and c, and three blocks of each run, weight and bias each
DEEP_GRADIENTS = 18


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> FrontEnd:
    # 200 blocks: the no_grad region is a block of its own, so it can open a stage
    path = write_model(tmp_path_factory.mktemp("deep"), DEEP)
    return run_front_end(FrontEndOptions(path, num_blocks=200, profile_repeats=0))


def hop_block(front: FrontEnd, op: str) -> int:
    """The block holding the first higher-order op `op` of the traced graph."""
    name = next(n.name for n in front.graph.nodes if n.target == f"torch.ops.higher_order.{op}")
    return next(b.index for b in front.chain.blocks if name in b.nodes)


def test_regions_in_a_middle_stage_verify(deep: FrontEnd) -> None:
    assert deep.graph.tracer == "export"
    block = hop_block(deep, "wrap_with_set_grad_enabled")
    last = len(deep.chain.blocks) - 1
    assert 0 < block < last - 1
    ranges = [(0, block - 1), (block, block + 1), (block + 2, last)]
    stages = generate_stages(deep.program, deep.graph, deep.chain, ranges)
    source = stages[1].source
    assert re.search(r"class Submod\d+\(torch\.nn\.Module\):", source)
    assert re.search(r"        self\.submod_\d+ = Submod\d+\(\)", source)
    assert "        with torch.set_grad_enabled(False):" in source
    assert "higher_order" not in source
    model, inputs, targets = deep.model_file.instantiate(deep.graph.batch_size)
    report = verify_stages(
        model,
        inputs,
        targets,
        deep.model_file.loss_fn,
        [(s.source, s.state, list(s.inputs), list(s.outputs)) for s in stages],
        deep.program.out_spec,
    )
    assert report.max_error <= 1e-6 and report.compared_gradients == DEEP_GRADIENTS
    # The stage holds no tensor of the sub-graphs': its weights are the model's, by the model's names.
    assert set(load_stage(source, stages[1].state, "s1").state_dict()) == set(stages[1].state)


@pytest.mark.slow
def test_regions_train_under_cloudless_run_like_plain_pytorch(deep: FrontEnd, tmp_path: Path) -> None:
    """Two stages, the second opening with the regions, a replicated first stage, micro-batch 4 where
    the trace was at 2 (torch.export bakes the traced size into its reshapes: the stages are traced
    again), two iterations: the parameters end as plain PyTorch's."""
    assert deep.graph.batch_size == 2
    block = hop_block(deep, "wrap_with_set_grad_enabled")
    last = len(deep.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        deep, build, [(0, block - 1, 2), (block, last, 1)], micro_batch=4, global_batch=8, iterations=2
    )
    stage_files = sorted(build.glob("regions/*/functions/*/stage.py"))
    assert len(stage_files) == 2 and "torch.set_grad_enabled(False)" in stage_files[1].read_text()
    assert "torch.autocast(" in stage_files[1].read_text()
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(deep.model_file.path), "-q"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and len(metrics["progress"]) == 2
    params = load_file(out / "model.safetensors")
    expected = reference_training(deep, workflow, workflow.regions[0].name)
    assert set(params) == set(expected) and len(params) == DEEP_GRADIENTS
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


# --- one transformers model: the Llama ------------------------------------------------------------


@pytest.mark.slow
def test_llama_trains_under_cloudless_run_like_plain_pytorch(tmp_path: Path) -> None:
    """A tiny transformers Llama split in the middle, a replicated first stage, two iterations: the
    parameters end as plain PyTorch's (whichever tracer and regions transformers' code needs)."""
    llama = run_front_end(FrontEndOptions(LLAMA, profile_repeats=0))
    last = len(llama.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        llama, build, [(0, last // 2, 2), (last // 2 + 1, last, 1)], micro_batch=4, global_batch=8, iterations=2
    )
    assert workflow.regions[0].functions[0].replicas == 2
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(LLAMA), "-q"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and len(metrics["progress"]) == 2
    params = load_file(out / "model.safetensors")
    expected = reference_training(llama, workflow, workflow.regions[0].name)
    # the file holds the model's state_dict keys: not its non-persistent buffers
    persistent = set(llama.model_file.build_model().state_dict())
    assert set(params) == set(expected) & persistent and len(params) == 21
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


# --- hand-written regions -------------------------------------------------------------------------


def test_no_grad_region_verifies_through_export(tmp_path: Path) -> None:
    result = verified(write_model(tmp_path, NO_GRAD), 3, tracer="export", num_blocks=8)
    assert result.front.graph.tracer == "export"
    assert result.verify is not None and result.verify.max_error <= 1e-6 and result.verify.compared_gradients == 6
    stage = region_stage(result, "with torch.set_grad_enabled(False):")
    assert "self.submod_1 = Submod1()" in result.stages[stage].source


def test_fx_refuses_a_no_grad_region_and_auto_falls_back_to_export(tmp_path: Path, compile_cli) -> None:
    """torch.fx records no grad mode: it used to trace the region as if gradients flowed through it."""
    path = write_model(tmp_path, NO_GRAD)
    result = verified(path, 2, num_blocks=8)
    assert result.front.graph.tracer == "export"
    assert "torch.no_grad() region" in result.front.program.fx_error
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"), "--tracer", "fx", "--repeats", "0")
    assert code == 2
    assert "torch.fx cannot keep the torch.no_grad() region" in stderr and "--tracer export" in stderr
    assert len(stderr.strip().splitlines()) == 1


def test_autocast_region_verifies_through_export(tmp_path: Path) -> None:
    result = verified(write_model(tmp_path, AUTOCAST), 3, tracer="export", num_blocks=8)
    assert result.verify is not None and result.verify.max_error <= 1e-6 and result.verify.compared_gradients == 6
    region_stage(
        result, "with torch.autocast(device_type='cpu', dtype=torch.bfloat16, enabled=True, cache_enabled=False):"
    )


def test_checkpointing_and_an_enable_grad_region_keep_the_models_gradients(tmp_path: Path) -> None:
    """torch.export traces a checkpointed layer as the layer (recomputation is a memory choice, not the
    gradient's); the enable_grad region inside no_grad still gives b its gradient through `gate`."""
    result = verified(write_model(tmp_path, CHECKPOINTED), 3, num_blocks=8)
    assert result.front.graph.tracer == "export"
    assert result.verify is not None and result.verify.max_error <= 1e-6 and result.verify.compared_gradients == 6


def test_nested_regions_render_nested_sub_graphs(tmp_path: Path) -> None:
    result = verified(write_model(tmp_path, NESTED), 2, num_blocks=8)
    assert result.verify is not None and result.verify.max_error <= 1e-6
    source = result.stages[region_stage(result, "with torch.set_grad_enabled(False):")].source
    assert "with torch.autocast(device_type='cpu', dtype=torch.bfloat16" in source
    # the autocast region's class is held by the no_grad region's, which the stage holds
    held = re.findall(r"self\.(\w+) = (\w+)\(\)", source)
    assert len(held) == 2 and held[0][1] != held[1][1]


def test_export_losing_a_no_grad_region_in_autocast_is_a_compile_error(tmp_path: Path, compile_cli) -> None:
    """Without --verify the build would train with gradients the model does not have."""
    path = write_model(tmp_path, NO_GRAD_IN_AUTOCAST)
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"), "--repeats", "0")
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    assert "torch.export changed the gradient of a.weight: it drops a torch.no_grad() region inside a" in stderr


def test_region_in_a_leaf_module_is_inlined(tmp_path: Path) -> None:
    path = write_model(tmp_path, LEAF)
    result = verified(path, 3, tracer="fx", leaf_modules=("Normalise",), num_blocks=6)
    assert result.front.graph.tracer == "fx"
    assert result.verify is not None and result.verify.max_error <= 1e-6
    source = result.stages[region_stage(result, "with torch.set_grad_enabled(False):")].source
    assert "self.norm_submod_1 = NormSubmod1()" in source


# --- control flow ---------------------------------------------------------------------------------

CONTROL_FLOW = """
    import torch
    from functorch.experimental.control_flow import map as control_map
    from torch import nn


    class Cond(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 16)
            self.c = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            h = torch.cond(h.sum() > 0, lambda t: torch.relu(self.b(t)), lambda t: torch.sigmoid(t) * 2, (h,))
            return self.c(h)


    class Map(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.w = nn.Parameter(torch.randn(16, 16) / 4)
            self.c = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            h = control_map(lambda row, w: torch.tanh(row @ w), h, self.w)
            return self.c(h)
"""


@pytest.mark.parametrize(("name", "op", "call"), [("Cond", "cond", "torch.cond("), ("Map", "map_impl", "control_map(")])
def test_control_flow_is_refused_at_compile_time_naming_line_and_module(
    name: str, op: str, call: str, tmp_path: Path, compile_cli
) -> None:
    # The modules sit beside the model file (torch runs cond and map through torch.compile, which needs
    # the module of the forward's code importable).
    nets = textwrap.dedent(CONTROL_FLOW)
    (tmp_path / "control_flow_nets.py").write_text(nets)
    line = next(i for i, text in enumerate(nets.splitlines(), 1) if call in text and "=" in text)
    path = tmp_path / "model.py"
    path.write_text(
        textwrap.dedent(_CONTRACT).replace(
            "from torch import nn\n", f"from torch import nn\nfrom control_flow_nets import {name} as Model\n"
        )
    )
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"), "--verify", "--repeats", "0")
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert f"control_flow_nets.py:{line}: torch.export turned the model's code" in stderr
    assert f"in the model's own forward ({name}) into torch.ops.higher_order.{op}" in stderr
    assert not (tmp_path / "b").exists()


class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from functorch.experimental.control_flow import map as control_map

        h = torch.tanh(self.a(x))
        h = torch.cond(h.sum() > 0, lambda t: torch.relu(t @ self.w), lambda t: torch.sigmoid(t), (h,))
        with torch.no_grad():
            scale = h.abs().mean() + 1
        return control_map(lambda row, w: torch.tanh(row @ w), h / scale, self.w)


def test_control_flow_sub_graphs_render_as_submodules() -> None:
    """Stage code can hold cond and map (the op called on the sub-graphs' modules, as torch runs it
    eagerly, autograd included), for when annotation can run them."""
    torch.manual_seed(0)
    model = _Branches()
    x = torch.randn(4, 8)
    program = export_module(model, (x,)).module()
    for node in [n for n in program.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        program.graph.erase_node(node)
    tensors = {n.target: fetch(program, n.target) for n in program.graph.nodes if n.op == "get_attr"}
    tensors = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    header = StageHeader(
        "branches",
        0,
        1,
        0,
        0,
        ("x",),
        ("out",),
        {
            k: (
                tuple(v.shape),
                str(v.dtype).removeprefix("torch."),
                "parameter" if isinstance(v, nn.Parameter) else "buffer",
            )
            for k, v in tensors.items()
        },
    )
    source = render_stage_source(program.graph, header)
    assert "torch.ops.higher_order.cond(" in source and "torch.ops.higher_order.map_impl(" in source
    assert "self.true_graph_0 = TrueGraph0()" in source and "self.body_graph_0 = BodyGraph0()" in source
    stage = load_stage(source, {k: v.detach() for k, v in tensors.items()}, "branches")
    expected = model(x)
    expected.sum().backward()
    got = stage(x)
    got = got[0] if isinstance(got, tuple | list) else got
    got.sum().backward()
    torch.testing.assert_close(got, expected)
    for name, param in stage.named_parameters():
        torch.testing.assert_close(param.grad, dict(model.named_parameters())[name].grad, msg=name)


def fetch(module: nn.Module, target: str):
    value = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


# --- the load check -------------------------------------------------------------------------------


def meta_inputs(front: FrontEnd, names) -> list[torch.Tensor]:
    metas = {n.name: n for n in front.graph.nodes}
    return [
        torch.empty(metas[n].outputs[0].shape, dtype=getattr(torch, metas[n].outputs[0].dtype), device="meta")
        for n in names
    ]


def test_a_stage_that_cannot_run_is_a_compile_error(deep: FrontEnd) -> None:
    block = hop_block(deep, "wrap_with_set_grad_enabled")
    stages = generate_stages(
        deep.program, deep.graph, deep.chain, [(0, block - 1), (block, len(deep.chain.blocks) - 1)]
    )
    stage = stages[1]
    inputs = meta_inputs(deep, stage.inputs)
    check_stage_loads(stage.source, stage.state, "stage 1 of 2", inputs)  # loads and runs on meta tensors
    # the failure: the stage calls a sub-graph module it does not hold
    held = re.search(r"        self\.(submod_\d+) = Submod\d+\(\)\n", stage.source)
    assert held
    broken = stage.source.replace(held.group(0), "")
    with pytest.raises(CompileError) as caught:
        check_stage_loads(broken, stage.state, "stage 1 of 2", inputs)
    message = str(caught.value)
    assert message.startswith("stage 1 of 2: the generated module's forward fails: AttributeError: ")
    assert f"'Stage' object has no attribute '{held.group(1)}'" in message
    assert re.search(rf"`\w+ = self\.{held.group(1)}\(", message)
    assert "\n" not in message
    # weights that do not fit: does not load
    wrong = dict(stage.state)
    wrong["c.weight"] = torch.zeros(3)
    with pytest.raises(CompileError, match=r"^stage 1 of 2: the generated module does not load: RuntimeError: "):
        check_stage_loads(stage.source, wrong, "stage 1 of 2")
    with pytest.raises(CompileError, match=r"does not load: SyntaxError: .* \(line \d+\)"):
        check_stage_loads(stage.source.replace("def forward(", "def forward((", 1), stage.state, "stage 1 of 2")
    # --verify reports a stage failing on the example micro-batch as one line too
    model, inputs, targets = deep.model_file.instantiate(deep.graph.batch_size)
    with pytest.raises(
        VerificationError, match=r"^the 2 stages fail on the example micro-batch: stage 1: AttributeError"
    ):
        verify_stages(
            model,
            inputs,
            targets,
            deep.model_file.loss_fn,
            [(s.source if s.index == 0 else broken, s.state, list(s.inputs), list(s.outputs)) for s in stages],
            deep.program.out_spec,
        )


def test_compile_refuses_to_write_a_stage_that_cannot_run(
    tmp_path: Path, compile_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --verify the broken stage used to be written, passed `--check`, and failed every
    invocation; the load check every compile runs stops it."""
    import cloudless.compiler.pipeline as pipeline

    render: Callable[..., str] = pipeline.render_stage_source
    monkeypatch.setattr(
        pipeline,
        "render_stage_source",
        lambda graph, header: render(graph, header).replace("        self.submod_1 = Submod1()\n", ""),
    )
    out = tmp_path / "b"
    code, _, stderr = compile_cli(
        str(write_model(tmp_path, NO_GRAD)), "-o", str(out), "--tracer", "export", "--repeats", "1", "--no-verify"
    )
    assert code == 2
    assert re.fullmatch(
        r"cloudless-compile: error: stage \d of \d \(blocks \d+-\d+\): the generated module's forward fails: "
        r"AttributeError: 'Stage' object has no attribute 'submod_1' \(line \d+: `.*`\)\n",
        stderr,
    ), stderr
    assert not out.exists()


LOOP_OVER_A_SIZE = """
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        for i in range(y.shape[1]):  # a loop over a size: torch.export specialises it, torch.fx cannot trace it
            y = y + x[:, i : i + 1]
        return y


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Gate(), nn.ReLU(), nn.Linear(4, 2))


def example_inputs(batch_size):
    return (torch.randn(batch_size, 4),)


def example_targets(batch_size):
    return torch.zeros(batch_size, dtype=torch.int64)
"""


def test_a_tracer_forced_by_flag_that_fails_names_the_flag_that_works(model_file, compile_cli, tmp_path) -> None:
    path = model_file(LOOP_OVER_A_SIZE)
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"), "--tracer", "fx", "--repeats", "0")
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert (
        "cannot trace the model" in stderr and "--tracer auto (the default), which falls back to torch.export" in stderr
    )
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "auto"), "--repeats", "1", "--plan-only")
    assert code == 0, stderr
