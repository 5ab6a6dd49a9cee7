"""Every sample compiles with --verify through the CLI, writing IR files valid against their schemas."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cloudless.ir import BlockChain, OpGraph, validate
from cloudless.ir.files import load_plan, load_workflow

from .conftest import SAMPLES

CASES = {
    # sample: (tracer, parameters it must report)
    "mlp_digits": ("fx", 17_226),
    "resnet50": ("fx", 25_557_032),
    "resnet101": ("fx", 44_549_160),
    "gpt2": ("fx", 123_751_680),
    "bert_large": ("export", 335_174_458),
    "llama_text": ("export", 656_512),
    "llama_lora": ("export", 131_072),  # the trained ones: adapters, embedding, head
    "mlp_digits_geo": ("fx", 17_226),
    "digits_jpeg": ("fx", 136_586),
}


@pytest.mark.parametrize(
    "sample", [pytest.param(name, marks=[] if name == "mlp_digits" else [pytest.mark.slow]) for name in CASES]
)
def test_sample_compiles_and_verifies(sample: str, compile_cli, tmp_path: Path) -> None:
    tracer, params = CASES[sample]
    out = tmp_path / "build"
    # 12 blocks and a 2 s solver limit keep planning quick here; the benchmark plans at the defaults.
    code, stdout, stderr = compile_cli(
        str(SAMPLES / f"{sample}.py"),
        "-o",
        str(out),
        "--verify",
        "--repeats",
        "1",
        "--blocks",
        "12",
        "--solver-time-limit",
        "2",
    )
    assert code == 0, stderr
    assert f"traced with torch.{tracer}" in stdout
    assert f"parameters  {params:,}" in stdout
    match = re.search(r"largest gradient error (\S+) \((\d+) gradients\)", stdout)
    assert match, stdout
    assert float(match.group(1)) <= 1e-4 and int(match.group(2)) > 0

    graph_doc = json.loads((out / "ir" / "graph.json").read_text())
    blocks_doc = json.loads((out / "ir" / "blocks.json").read_text())
    validate(graph_doc, "graph", "graph.json")
    validate(blocks_doc, "blocks", "blocks.json")
    graph = OpGraph.load(out / "ir" / "graph.json")
    chain = BlockChain.load(out / "ir" / "blocks.json")
    assert graph.param_count == params
    assert 1 <= len(chain.blocks) <= 12
    assert sum(len(b.nodes) for b in chain.blocks) == sum(
        1 for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")
    )
    assert all(b.forward_s > 0 for b in chain.blocks)
    assert [p.name for p in tmp_path.iterdir()] == ["build"]  # no staging folder left behind

    # The deployable tree: every function package of the plan (the compile ran every validator on it).
    workflow = load_workflow(out / "workflow.yaml")
    functions = workflow.regions[0].functions
    assert len(functions) == len(load_plan(out / "plan.json").stages)
    for function in functions:
        for name in ("handler.py", "stage.py", "weights.safetensors", "Dockerfile", "requirements.txt"):
            assert (out / function.package / name).is_file(), (function.name, name)
    for name in ("stack.yaml", "template.yaml", "statemachine.asl.json"):
        assert (out / "regions" / workflow.regions[0].name / name).is_file()
    assert (out / "report.md").is_file() and (out / "samconfig.toml").is_file()

    plan = load_plan(out / "plan.json")  # validated against its schema
    assert plan.stages[0].blocks[0] == 0 and plan.stages[-1].blocks[1] == len(chain.blocks) - 1
    for baseline in plan.baselines:
        if baseline.feasible:
            assert baseline.cost_ratio is not None and baseline.cost_ratio <= 1 + 1e-9, baseline
        else:
            assert baseline.reason


@pytest.mark.slow
def test_tied_embeddings_are_one_shared_parameter(compile_cli, tmp_path: Path) -> None:
    code, _, stderr = compile_cli(str(SAMPLES / "gpt2.py"), "-o", str(tmp_path / "b"), "--repeats", "0", "-q")
    assert code == 0, stderr
    graph = OpGraph.load(tmp_path / "b" / "ir" / "graph.json")
    chain = BlockChain.load(tmp_path / "b" / "ir" / "blocks.json")
    assert "wte.weight" in graph.parameters and "lm_head.weight" not in graph.parameters
    assert chain.shared_params == {"wte.weight": 50257 * 768 * 4}
    holders = [b.index for b in chain.blocks if "wte.weight" in b.params]
    assert holders[0] == 0 and holders[-1] == len(chain.blocks) - 1
