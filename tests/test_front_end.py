"""The front end on small models: annotation values, liveness, splitting, verification, codegen."""

from __future__ import annotations

import ast
import gc
import json
import random
from pathlib import Path

import pytest
import torch

from cloudless.compiler.frontend.annotate import _Annotator
from cloudless.compiler.frontend.coarsen import block_cuts, crossing_values, liveness
from cloudless.compiler.frontend.verify import verify_stages
from cloudless.compiler.pipeline import (
    Compiled,
    CompileOptions,
    FrontEnd,
    FrontEndOptions,
    compile_model,
    generate_stages,
    run_front_end,
)
from cloudless.ir import BlockChain, OpGraph, SchemaError, validate

from .conftest import MODELS


def front_end(name: str, **options) -> FrontEnd:
    options.setdefault("profile_repeats", 0)
    return run_front_end(FrontEndOptions(MODELS / f"{name}.py", **options))


def verified(name: str, stages: int, **options) -> Compiled:
    """The whole compile without a plan: split into `stages` and verified (nothing written)."""
    options.setdefault("profile_repeats", 0)
    return compile_model(CompileOptions(FrontEndOptions(MODELS / f"{name}.py", **options), verify_stages=stages))


def verify_ranges(result, ranges):
    stages = generate_stages(result.program, result.graph, result.chain, ranges)
    model_file = result.model_file
    model, inputs, targets = model_file.instantiate(result.graph.batch_size)
    return verify_stages(
        model,
        inputs,
        targets,
        model_file.loss_fn,
        [(s.source, s.state, s.inputs, s.outputs) for s in stages],
        result.program.out_spec,
    ), stages


def random_ranges(rng: random.Random, blocks: int) -> list[tuple[int, int]]:
    count = rng.randint(1, blocks)
    cuts = sorted(rng.sample(range(blocks - 1), count - 1))
    starts = [0] + [c + 1 for c in cuts]
    ends = cuts + [blocks - 1]
    return list(zip(starts, ends, strict=True))


def test_annotation_values() -> None:
    result = front_end("tricky", num_blocks=6)
    graph = result.graph
    model = result.model
    # A tied parameter is counted once, in its own dtype.
    unique = {id(p): p for p in model.parameters()}
    assert graph.param_bytes == sum(p.numel() * p.element_size() for p in unique.values())
    assert "head.weight" not in graph.parameters and "embed.weight" in graph.parameters
    assert sum(n.param_bytes for n in graph.nodes) == graph.param_bytes
    # Shapes and FLOPs of the first projection: batch 4, 16 -> 16.
    linear = graph.node("linear")
    assert [m.shape for m in linear.outputs] == [(4, 16)] and linear.outputs[0].dtype == "float32"
    assert linear.flops == 2 * 4 * 16 * 16
    assert linear.output_bytes == 4 * 16 * 4
    # The module called twice gives two nodes in the same module.
    assert [n.module for n in graph.nodes if n.target.endswith("linear") and n.module == "proj"] == ["proj", "proj"]
    # relu saves its output for backward: activation bytes, not parameters.
    assert graph.node("relu").saved_bytes == 4 * 16 * 4
    assert graph.node("embedding").saved_bytes == 0 or graph.node("embedding").saved_bytes == 4 * 7 * 8
    assert graph.outputs == ["linear_4", "add"]


def test_annotation_leaves_nothing_of_its_run_alive() -> None:
    """Its saved-tensor hook lives as long as the saved tensors, in C++: it once held the interpreter,
    whose values held the autograd graph, whose saved tensors held the hook (a big model's every
    activation, kept for the rest of the compile)."""
    result = front_end("tricky", num_blocks=6)
    gc.collect()
    activations = [
        o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.requires_grad and o.grad_fn is not None
    ]
    assert not [o for o in gc.get_objects() if isinstance(o, _Annotator)]
    assert not activations, [tuple(t.shape) for t in activations[:5]]
    assert result.flat_outputs and all(not t.requires_grad for t in result.flat_outputs if isinstance(t, torch.Tensor))


def test_crossing_bytes_count_skip_connections() -> None:
    result = front_end("tricky", num_blocks=6)
    graph = result.graph
    live = liveness(graph)
    names = [n.name for n in live.positions]
    skip = graph.node("mean")
    start, end = names.index("mean"), names.index("add")
    for cut in range(start, end):
        assert "mean" in crossing_values(graph, [cut])[0]
        assert live.crossing_bytes[cut] >= skip.output_bytes
    # The model inputs cross every cut before their last use: `scale` is used by `mul`.
    assert "scale" in crossing_values(graph, [names.index("mul") - 1])[0]


@pytest.mark.parametrize("seed", range(6))
def test_random_contiguous_splits_reproduce_the_model(seed: int) -> None:
    result = front_end("tricky", num_blocks=8)
    rng = random.Random(seed)
    report, stages = verify_ranges(result, random_ranges(rng, len(result.chain.blocks)))
    assert report.max_error <= 1e-6
    assert report.compared_gradients == len({id(p) for p in result.model.parameters()})


def test_tied_weight_gradients_are_summed_across_stages() -> None:
    result = front_end("tricky", num_blocks=8)
    first = next(i for i, b in enumerate(result.chain.blocks) if "embed.weight" in b.params)
    ranges = [(0, first), (first + 1, len(result.chain.blocks) - 1)]
    report, stages = verify_ranges(result, ranges)
    holders = [s for s in stages if "embed.weight" in s.state]
    assert len(holders) == 2  # both ends of the model hold a copy
    assert report.gradient_error <= 1e-6
    assert result.chain.shared_params["embed.weight"] == 50 * 16 * 4
    # `proj` is called twice; when its calls fall in different blocks it is shared too.
    assert set(result.chain.shared_params) <= {"embed.weight", "proj.weight", "proj.bias"}


def test_in_place_ops_constrain_cuts_and_verify() -> None:
    result = front_end("inplace", num_blocks=12)
    live = liveness(result.graph)
    mutators = {n.name: n.mutates for n in live.positions if n.mutates}
    assert mutators, "ReLU(inplace=True) and add_ must be seen as mutations"
    for index in range(len(result.chain.blocks) - 1):
        cut = result.chain.blocks[index].last
        for value in crossing_values(result.graph, [cut])[0]:
            later = [n for n in live.positions[cut + 1 :] if value in n.mutates]
            assert not later, f"{value} crosses cut {cut} and is mutated after it"
    blocks = len(result.chain.blocks)
    report, _ = verify_ranges(result, [(b, b) for b in range(blocks)])
    assert report.max_error <= 1e-6 and report.buffer_error <= 1e-6


def test_fx_failure_falls_back_to_export() -> None:
    result = verified("loop", 3, num_blocks=4)
    assert result.front.graph.tracer == "export"
    assert "TypeError" in result.front.program.fx_error or "TraceError" in result.front.program.fx_error
    assert result.verify.max_error <= 1e-6


def test_leaf_modules_stay_single_nodes_and_stages_import_only_torch() -> None:
    result = verified("tricky", 3, num_blocks=6, leaf_modules=("Linear",))
    linear_nodes = [n for n in result.front.graph.nodes if n.op == "call_module"]
    assert {n.target for n in linear_nodes} >= {"proj", "mix.0", "mix.2", "head"}
    assert result.verify.max_error <= 1e-6
    for stage in result.stages:
        assert imported_modules(stage.source) <= {"torch"}
        assert "self.proj(" not in stage.source


def imported_modules(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
    return found


@pytest.mark.parametrize("name", [pytest.param("hf_bert_tiny", marks=pytest.mark.slow), "hf_gpt2_tiny"])
def test_transformers_models_go_through_export(name: str) -> None:
    result = verified(name, 4, num_blocks=10)
    assert result.front.graph.tracer == "export"
    assert result.verify.max_error <= 1e-5
    # BERT ties its decoder to the word embeddings, GPT-2 its head to wte: one entry, shared across blocks.
    shared = result.front.chain.shared_params
    assert len(shared) >= 1, shared
    for stage in result.stages:
        assert imported_modules(stage.source) <= {"torch", "operator", "math", "builtins"}


def test_ir_round_trip_and_schema(tmp_path: Path) -> None:
    result = front_end("tricky", num_blocks=6, profile_repeats=1)
    graph_path, blocks_path = tmp_path / "graph.json", tmp_path / "blocks.json"
    result.graph.save(graph_path)
    result.chain.save(blocks_path)
    assert OpGraph.load(graph_path) == result.graph
    assert BlockChain.load(blocks_path) == result.chain
    assert result.chain.machine.reference_gflops > 0
    assert all(b.forward_s > 0 and b.backward_s >= 0 for b in result.chain.blocks)
    broken = json.loads(graph_path.read_text())
    broken["nodes"][3]["flops"] = -1
    with pytest.raises(SchemaError, match=r"graph.json: key nodes/3/flops"):
        validate(broken, "graph", "graph.json")
    broken = json.loads(blocks_path.read_text())
    del broken["blocks"][0]["forward_s"]
    with pytest.raises(SchemaError, match=r"blocks.json: key blocks/0: 'forward_s' is a required property"):
        BlockChain.from_json(broken, "blocks.json")


def test_same_inputs_give_identical_graph_and_stage_source() -> None:
    first = verified("tricky", 3, num_blocks=6)
    second = verified("tricky", 3, num_blocks=6)
    graphs = [json.dumps(c.front.graph.to_json(), sort_keys=True) for c in (first, second)]
    assert graphs[0] == graphs[1]
    assert [s.source for s in first.stages] == [s.source for s in second.stages]
    # Block structure (not the measured times) is deterministic too.
    strip = lambda c: [{k: v for k, v in b.items() if not k.endswith("_s")} for b in c.to_json()["blocks"]]  # noqa: E731
    assert strip(first.front.chain) == strip(second.front.chain)


def test_block_cuts_reject_non_contiguous_ranges() -> None:
    result = front_end("tricky", num_blocks=6)
    with pytest.raises(ValueError, match="contiguous"):
        block_cuts(result.chain, [(0, 1), (3, 5)])
    with pytest.raises(ValueError, match="cover"):
        block_cuts(result.chain, [(0, 1), (2, 3)])


def test_verification_fails_clearly_on_a_wrong_stage() -> None:
    result = front_end("tricky", num_blocks=6)
    stages = generate_stages(result.program, result.graph, result.chain, [(0, 2), (3, 5)])
    broken = stages[1].source.replace("return (", "return (0.5 * ", 1)
    model, inputs, targets = result.model_file.instantiate(4)
    from cloudless.compiler.errors import VerificationError

    with pytest.raises(VerificationError, match=r"largest error .* exceeds the tolerance 0.0001"):
        verify_stages(
            model,
            inputs,
            targets,
            result.model_file.loss_fn,
            [
                (stages[0].source, stages[0].state, stages[0].inputs, stages[0].outputs),
                (broken, stages[1].state, stages[1].inputs, stages[1].outputs),
            ],
            result.program.out_spec,
        )
    assert torch.is_grad_enabled()


def test_op_graph_is_a_dag_in_topological_order() -> None:
    import networkx as nx

    result = front_end("tricky", num_blocks=6)
    digraph = result.graph.digraph
    assert nx.is_directed_acyclic_graph(digraph)
    order = {n.name: i for i, n in enumerate(result.graph.nodes)}
    assert all(order[u] < order[v] for u, v in digraph.edges)
    assert digraph.number_of_nodes() == len(result.graph.nodes)
