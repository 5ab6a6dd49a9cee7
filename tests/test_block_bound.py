"""A block holds at most a bound of parameters, cut at the ends of the model's repeated layers, so that a
model planned from shapes is profiled a layer at a time (identical layers once), and annotation keeps
no layer's activations past their use: the front end's memory follows a layer, not the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cloudless.compiler.frontend.coarsen import MAX_BLOCK_PARAM_BYTES, repeated_unit
from cloudless.compiler.frontend.profile import block_keys
from cloudless.compiler.pipeline import FrontEnd, FrontEndOptions, run_front_end

#: an embedding, LAYERS identical residual layers (`layers.3`) of two WIDTH x WIDTH linears, a head
LAYERED = """
    import torch
    from torch import nn

    TRAINING = {{"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 4}}
    WIDTH, LAYERS, VOCAB = {width}, {layers}, 100


    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(WIDTH, WIDTH)
            self.down = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))


    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return Net()


    def example_inputs(batch_size: int):
        return (torch.randint(0, VOCAB, (batch_size, {tokens}), generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, VOCAB, (batch_size, {tokens}), generator=torch.Generator().manual_seed(1))


    def loss_fn(output, target):
        return nn.functional.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
"""


def layered(folder: Path, width: int, layers: int, tokens: int = 6) -> tuple[Path, int]:
    """The model file, and one layer's parameter bytes."""
    path = folder / "layered.py"
    path.write_text(textwrap.dedent(LAYERED.format(width=width, layers=layers, tokens=tokens)))
    return path, 2 * (width * width + width) * 4


#: runs a front end (FrontEndOptions' fields as JSON in argv[2]) on the model file argv[1] and prints how
#: far this process's memory high-water mark (VmHWM) rose over the step argv[3], from the resident
#: memory the step started at. Run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_): every
#: tensor of a megabyte or more is mapped on its own and returned when freed, so the resident memory is
#: what lives (glibc's adaptive threshold keeps freed tensors in its heap, resident)
MEASURE = """
import json, sys
from contextlib import contextmanager
from pathlib import Path
from cloudless.compiler.pipeline import FrontEndOptions, run_front_end

def high_water():
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))

growth = []

@contextmanager
def timed(name):
    if name != sys.argv[3]:
        yield
        return
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to the resident size
    start = high_water()
    yield
    growth.append(high_water() - start)

front = run_front_end(FrontEndOptions(Path(sys.argv[1]), **json.loads(sys.argv[2])), timed)
saved = [(n.module, n.saved_bytes) for n in front.graph.nodes]
timed_ = [b.forward_s > 0 and b.backward_s > 0 for b in front.chain.blocks]
print("RESULT", json.dumps({"growth": growth[0], "saved": saved, "timed": timed_}))
"""


def step_growth(path: Path, step: str, **options: object) -> dict[str, Any]:
    """How far a front end's memory rises over `step`, in a process of its own (`MEASURE`): "growth"
    (bytes), "saved" (each node's module and saved bytes), "timed" (per block: were its times measured)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    command = [sys.executable, "-c", MEASURE, str(path), json.dumps(options), step]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.split("RESULT")[-1])


def layers_of(front: FrontEnd) -> list[set[str]]:
    """Per block, the model's layers (`layers.3`) it holds operations of."""
    nodes = {n.name: n for n in front.graph.nodes}
    units = [{repeated_unit(nodes[name].module) for name in b.nodes} for b in front.chain.blocks]
    return [{u for u in held if u.startswith("layers.")} for held in units]


def test_blocks_past_the_bound_end_at_the_layers_ends_and_identical_layers_are_one_key(tmp_path: Path) -> None:
    path, layer = layered(tmp_path, 256, 8)
    bound = layer * 3 // 2  # room for one layer, not two
    balanced = run_front_end(FrontEndOptions(path, num_blocks=2, profile_repeats=0)).chain
    assert max(b.param_bytes for b in balanced.blocks) > 3 * layer  # two balanced blocks of four layers each
    fronts = [
        run_front_end(FrontEndOptions(path, num_blocks=2, max_block_bytes=bound, profile_repeats=0, stand_ins=s))
        for s in (False, True)
    ]
    chain = fronts[0].chain
    assert all(b.param_bytes + b.buffer_bytes <= bound for b in chain.blocks)
    # each layer whole in a block of its own (the small embedding and head join the first and the last),
    # whichever path planned it
    assert layers_of(fronts[0]) == [{f"layers.{i}"} for i in range(8)]
    assert [b.nodes for b in fronts[1].chain.blocks] == [b.nodes for b in chain.blocks]
    keys = block_keys(fronts[1].graph, fronts[1].chain)
    assert len({keys[i] for i in range(1, 7)}) == 1  # the profile times one layer for the six between


def test_a_model_within_the_bound_keeps_its_balanced_blocks(tmp_path: Path) -> None:
    path, layer = layered(tmp_path, 64, 8)
    balanced = run_front_end(FrontEndOptions(path, num_blocks=4, profile_repeats=0)).chain
    assert max(b.param_bytes for b in balanced.blocks) > layer  # cut inside layers and across them
    assert MAX_BLOCK_PARAM_BYTES > sum(b.param_bytes for b in balanced.blocks)
    bounded = run_front_end(FrontEndOptions(path, num_blocks=4, max_block_bytes=10 * layer, profile_repeats=0)).chain
    assert [b.nodes for b in bounded.blocks] == [b.nodes for b in balanced.blocks]


@pytest.mark.slow
def test_the_profile_of_a_model_planned_from_shapes_holds_one_layer_of_weights(tmp_path: Path) -> None:
    """Eight 32 MiB layers: in two balanced blocks the profile makes four layers' weights and their
    gradients at once (~256 MiB); bounded to a layer a block, one layer's (~64 MiB)."""
    path, layer = layered(tmp_path, 2048, 8)
    options = {"num_blocks": 2, "profile_repeats": 2, "stand_ins": True}
    unbounded = step_growth(path, "profile", **options, max_block_bytes=1 << 40)
    bounded = step_growth(path, "profile", **options, max_block_bytes=layer * 3 // 2)
    assert all(bounded["timed"]) and len(bounded["timed"]) == 8 and all(unbounded["timed"])
    assert 2 * layer < bounded["growth"] < 4 * layer < 8 * layer < unbounded["growth"], (bounded, unbounded, layer)


@pytest.mark.slow
def test_annotation_keeps_no_layer_activations_past_their_use(tmp_path: Path) -> None:
    """Sixteen layers saving two 8 MiB activations each: annotation kept all 256 MiB until its run
    ended; it keeps none past its use, and records the same saved bytes per layer."""
    path, _ = layered(tmp_path, 256, 16, tokens=4096)
    activation = 2 * 4096 * 256 * 4  # one (batch, tokens, width) float tensor
    measured = step_growth(path, "annotate", profile_repeats=0, stand_ins=True)
    per_layer = [
        sum(saved for module, saved in measured["saved"] if repeated_unit(module) == f"layers.{i}") for i in range(16)
    ]
    # the layer's input (saved by `up`) and relu's output (by relu and by `down`: its storage once)
    assert per_layer == [2 * activation] * 16, per_layer
    assert 0 < measured["growth"] < sum(per_layer) / 2, (measured["growth"], sum(per_layer))
