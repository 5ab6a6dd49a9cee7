"""Fine-tuning recipes train as a plain PyTorch loop trains them, in a pipeline with replicas.

Frozen parameters (requires_grad=False as build_model() returns them) stay exactly as built: no
gradient, no optimizer state, no weight decay, no replica sync, no checkpoint of them."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cloudless.codegen.validate import BuildCheckError, check_build
from cloudless.compiler.errors import ModelFileError
from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.compiler.pipeline import FrontEnd, FrontEndOptions, run_front_end
from cloudless.ir import protocol
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.function.worker import StageWorker
from cloudless.runtimes.storage.channels import DirectoryChannel
from cloudless.runtimes.storage.tensors import pack, unpack
from tests.runtime_cases import reference_training, write_packages, write_training_data

FROZEN_BACKBONE = """
    import torch
    from torch import nn

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 3}


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
        )
        for param in model[:3].parameters():  # a frozen backbone, as a fine-tuning recipe freezes one
            param.requires_grad_(False)
        return model


    def example_inputs(batch_size: int):
        return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, 4, (batch_size,), generator=torch.Generator().manual_seed(1))


    def make_optimizer(params):
        # weight decay moves any parameter the optimizer holds and steps with a gradient, even a zero one
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


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

FROZEN_NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory) -> FrontEnd:
    path = tmp_path_factory.mktemp("frozen") / "model.py"
    path.write_text(textwrap.dedent(FROZEN_BACKBONE))
    return run_front_end(FrontEndOptions(path, profile_repeats=0))


def test_frozen_parameters_are_planned_as_weights_only(frozen: FrontEnd) -> None:
    """The planner's memory and sync terms count trainable parameters only."""
    trainable = sum(p.numel() * 4 for n, p in frozen.model_file.build_model().named_parameters() if p.requires_grad)
    assert frozen.graph.param_bytes == trainable
    assert {n for n, p in frozen.graph.parameters.items() if not p.trainable} == set(FROZEN_NAMES)
    assert sum(b.param_bytes for b in frozen.chain.blocks) == trainable


@pytest.mark.slow
def test_a_frozen_backbone_trains_in_a_replicated_pipeline_as_plain_pytorch(frozen: FrontEnd, tmp_path: Path) -> None:
    last = len(frozen.chain.blocks) - 1
    cut = next(b.index for b in frozen.chain.blocks if "3.weight" in {*b.params} or b.index == last // 2)
    build = tmp_path / "build"
    workflow = write_packages(
        frozen, build, [(0, cut, 2), (cut + 1, last, 2)], micro_batch=2, global_batch=8, iterations=3
    )
    functions = workflow.regions[0].functions
    held = {name for f in functions for name in f.frozen_parameters}
    assert held == set(FROZEN_NAMES) and all(f.replicas == 2 for f in functions)
    stage_source = (build / functions[0].package / "stage.py").read_text()
    assert "'0.weight': ((16, 8), 'float32', 'frozen')" in stage_source
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(frozen.model_file.path), "-q"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and len(metrics["progress"]) == 3
    params = load_file(out / "model.safetensors")
    expected = reference_training(frozen, workflow, workflow.regions[0].name)
    assert set(params) == set(expected)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    built = frozen.model_file.build_model().state_dict()
    for name in FROZEN_NAMES:  # exactly as built: not a rounding's difference
        assert torch.equal(params[name], built[name]), name
    assert not torch.equal(params["6.weight"], built["6.weight"])  # the head trained


def test_no_checkpoint_or_optimizer_state_holds_a_frozen_parameter(frozen: FrontEnd, tmp_path: Path) -> None:
    build = tmp_path / "build"
    last = len(frozen.chain.blocks) - 1
    workflow = write_packages(frozen, build, [(0, last, 1)], micro_batch=2, global_batch=8, iterations=2)
    function = workflow.regions[0].functions[0]
    storage = DirectoryChannel(tmp_path / "storage")
    write_training_data(frozen, storage, workflow.regions[0].name)
    worker = StageWorker(build / function.package, storage)
    assert [name for name, _ in worker.context.trained_parameters()] == ["4.weight", "4.bias", "6.weight", "6.bias"]
    result = worker.run(0, 2, 0, timeout=30)
    assert result.status == "done"
    state = worker.checkpoints.state()
    assert not any(name.endswith(f"/{frozen_name}") for name in state for frozen_name in FROZEN_NAMES), sorted(state)
    assert any(key.startswith(protocol.OPTIMIZER_PREFIX + "6.weight/") for key in state)
    # a worker resuming from that checkpoint gets the frozen weights from its package
    resumed = StageWorker(build / function.package, storage)
    resumed.checkpoints.load_state(2, timeout=5)
    for name, value in worker.context.module.state_dict().items():
        assert torch.equal(resumed.context.module.state_dict()[name], value), name


def test_check_finds_a_frozen_flag_that_does_not_match_the_workflow(
    frozen: FrontEnd, compile_cli, tmp_path: Path
) -> None:
    build = tmp_path / "build"
    code, _, stderr = compile_cli(str(frozen.model_file.path), "-o", str(build), "--repeats", "1", "-q")
    assert code == 0, stderr
    check_build(build)
    (stage,) = build.glob("regions/*/functions/*-s0/stage.py")
    assert "'0.weight': ((16, 8), 'float32', 'frozen')" in stage.read_text()
    stage.write_text(stage.read_text().replace("((16, 8), 'float32', 'frozen')", "((16, 8), 'float32', 'parameter')"))
    with pytest.raises(BuildCheckError, match=r"stage\.py: key TENSORS: frozen \['0\.bias', '2\.weight', '2\.bias'\]"):
        check_build(build)


def test_data_that_does_not_fit_the_examples_stops_the_run_before_any_function(
    frozen: FrontEnd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: a load_shard item wider than example_inputs used to fail inside a function at
    iteration 0 with torch's matmul message."""
    build = tmp_path / "build"
    last = len(frozen.chain.blocks) - 1
    write_packages(frozen, build, [(0, last, 1)], micro_batch=2, global_batch=8, iterations=1)
    wide = tmp_path / "wide.py"
    wide.write_text(
        frozen.model_file.path.read_text().replace(
            "return (self.inputs[0][i],), self.targets[i]", "return (torch.zeros(9),), self.targets[i]"
        )
    )
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(wide), "-q"]) == 2
    assert re.fullmatch(  # the first sample staged: a train split's are staged in staging_order
        re.escape(f"cloudless-run: {wide}: load_shard('aws-us-east-1', 'train')[")
        + r"\d+"
        + re.escape("]: input 0 is float32 of shape [9], but the example's is float32 of shape [8] (without the batch ")
        + "dimension\\)\n",
        capsys.readouterr().err,
    )
    assert not (out / "logs").exists()  # no function started


# --- parameter groups ------------------------------------------------------------------------------

GROUPS = (
    """
    import torch
    from torch import nn

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 4}


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
        )


    def make_optimizer(named_parameters):
        # the transformers recipe: no weight decay on biases and norms; here also a slower head
        decay = [p for n, p in named_parameters if p.ndim >= 2 and n != "5.weight"]
        no_decay = [p for n, p in named_parameters if p.ndim < 2]
        head = [p for n, p in named_parameters if n == "5.weight"]
        groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}, {"params": head, "lr": 0.003}]
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


    def make_scheduler(optimizer, iterations):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 3))  # warm-up
"""
    + FROZEN_BACKBONE[FROZEN_BACKBONE.index("    def example_inputs") : FROZEN_BACKBONE.index("    def make_optimizer")]
    + (FROZEN_BACKBONE[FROZEN_BACKBONE.index("    class Rows") :])
)


@pytest.fixture(scope="module")
def grouped(tmp_path_factory: pytest.TempPathFactory) -> FrontEnd:
    path = tmp_path_factory.mktemp("groups") / "model.py"
    path.write_text(textwrap.dedent(GROUPS))
    return run_front_end(FrontEndOptions(path, profile_repeats=0))


def test_parameter_groups_are_recorded_by_name_with_each_groups_schedule(grouped: FrontEnd, tmp_path: Path) -> None:
    last = len(grouped.chain.blocks) - 1
    workflow = write_packages(grouped, tmp_path / "build", [(0, last, 1)], micro_batch=2, global_batch=8, iterations=4)
    spec = workflow.optimizer
    assert spec.class_name == "AdamW" and spec.options["lr"] == 0.01 and spec.options["weight_decay"] == 0.1
    assert [g.parameters for g in spec.groups] == [
        ("0.weight", "3.weight"),
        ("0.bias", "1.weight", "1.bias", "3.bias", "5.bias"),
        ("5.weight",),
    ]
    assert [dict(g.options) for g in spec.groups] == [{}, {"weight_decay": 0.0}, {"lr": 0.003}]
    # each group's rates are what the model file's scheduler gives a plain loop's optimizer
    model = grouped.model_file.build_model()
    optimizer = grouped.model_file.make_optimizer(list(model.named_parameters()))
    scheduler = grouped.model_file.make_scheduler(optimizer, 4)
    for iteration in range(4):
        for index, group in enumerate(optimizer.param_groups):
            assert spec.learning_rate(iteration, 4, index) == pytest.approx(group["lr"], rel=1e-12)
        optimizer.step()
        scheduler.step()


@pytest.mark.slow
def test_parameter_groups_train_in_a_replicated_pipeline_as_plain_pytorch(grouped: FrontEnd, tmp_path: Path) -> None:
    last = len(grouped.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        grouped, build, [(0, last // 2, 2), (last // 2 + 1, last, 2)], micro_batch=2, global_batch=8, iterations=4
    )
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(grouped.model_file.path), "-q"]) == 0
    params = load_file(out / "model.safetensors")
    expected = reference_training(grouped, workflow, workflow.regions[0].name)
    assert set(params) == set(expected)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


# --- gradient clipping ---------------------------------------------------------------------------

#: the frozen backbone's model with every layer trained, a rate high enough that clipping bites, and
#: the head's weight tied to nothing: clipping over all stages
CLIPPED = FROZEN_BACKBONE.replace(
    """        for param in model[:3].parameters():  # a frozen backbone, as a fine-tuning recipe freezes one
            param.requires_grad_(False)
""",
    "",
).replace('"iterations": 3}', '"iterations": 3, "max_grad_norm": 0.05}')


@pytest.mark.slow
def test_clipping_to_the_global_norm_trains_in_a_replicated_pipeline_as_plain_pytorch(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(CLIPPED))
    assert "max_grad_norm" in path.read_text() and "requires_grad_" not in path.read_text()
    front = run_front_end(FrontEndOptions(path, profile_repeats=0))
    last = len(front.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        front, build, [(0, last // 2, 2), (last // 2 + 1, last, 2)], micro_batch=2, global_batch=8, iterations=3
    )
    assert workflow.run.max_grad_norm == 0.05
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(path), "-q"]) == 0
    params = load_file(out / "model.safetensors")
    expected = reference_training(front, workflow, workflow.regions[0].name)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # clipping bit: the same run without it ends elsewhere
    unclipped = dataclasses.replace(workflow, run=dataclasses.replace(workflow.run, max_grad_norm=None))
    free = reference_training(front, unclipped, workflow.regions[0].name)
    assert any(not torch.allclose(free[name], expected[name], atol=1e-4) for name in expected)


@pytest.mark.parametrize("value", ["0", "-1.0", "float('nan')", "'1'"])
def test_a_max_grad_norm_that_is_no_positive_number_is_one_error(value: str, tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(CLIPPED).replace('"max_grad_norm": 0.05', f'"max_grad_norm": {value}'))
    with pytest.raises(
        ModelFileError,
        match=r"model\.py: TRAINING\['max_grad_norm'\] is .*; expected (a positive number|int or float)$",
    ):
        load_model_file(path)


# --- peft / LoRA ---------------------------------------------------------------------------------

LORA = """
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from torch import nn

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 3}


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
        )
        # modules_to_save: the head trained whole; peft keeps its original, which forward never uses
        lora = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, modules_to_save=["lm_head"]
        )
        return get_peft_model(transformers.LlamaForCausalLM(config), lora)


    def example_inputs(batch_size: int):
        return (torch.randint(0, 64, (batch_size, 16), generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, 64, (batch_size, 16), generator=torch.Generator().manual_seed(1))


    def loss_fn(output, target):
        return nn.functional.cross_entropy(output.logits.reshape(-1, 64), target.reshape(-1))


    def make_optimizer(params):
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


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


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> FrontEnd:
    path = tmp_path_factory.mktemp("lora") / "model.py"
    path.write_text(textwrap.dedent(LORA))
    return run_front_end(FrontEndOptions(path, profile_repeats=0))


def test_a_peft_model_plans_its_adapters_as_the_only_trained_parameters(lora: FrontEnd) -> None:
    model = lora.model_file.build_model()
    adapters = {name for name, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in name or "modules_to_save" in name for name in adapters)
    # kilobytes to sync and hold optimizer state for, not the base model
    assert lora.graph.param_bytes == sum(p.numel() * 4 for p in model.parameters() if p.requires_grad) < 20_000
    assert {n for n, p in lora.graph.parameters.items() if p.trainable} == adapters


@pytest.mark.slow
def test_a_peft_model_trains_its_adapters_in_a_replicated_pipeline_and_saves_them_as_peft(
    lora: FrontEnd, tmp_path: Path
) -> None:
    from peft import PeftModel

    last = len(lora.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        lora, build, [(0, last // 2, 2), (last // 2 + 1, last, 2)], micro_batch=2, global_batch=8, iterations=3
    )
    assert workflow.data.adapter == "peft"
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(lora.model_file.path), "-q"]) == 0
    params = load_file(out / "model.safetensors")
    expected = reference_training(lora, workflow, workflow.regions[0].name)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    built = lora.model_file.build_model()
    assert not built.load_state_dict(params, strict=True).missing_keys
    trained = {name for name, p in built.named_parameters() if p.requires_grad}
    before = lora.model_file.build_model().state_dict()
    for name, value in params.items():  # the base model exactly as built, every adapter moved
        assert torch.equal(value, before[name]) == (name not in trained), name
    # the adapter as peft saves one, loaded by peft onto a fresh base model
    assert {p.name for p in (out / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    base = lora.model_file.build_model().unload()  # the base model without the adapter's layers
    loaded = PeftModel.from_pretrained(base, out / "adapter")
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, params[name], rtol=0, atol=0, msg=name)


# --- bf16 mixed precision --------------------------------------------------------------------------

#: blocks on a residual stream; under autocast the stream is bf16 (each block's linear gives bf16) or,
#: with FLOAT32_STREAM, float32 (kept so, as mixed-precision transformers keep theirs): then the stage
#: boundary carries a float32 activation that travels as bf16 and is given back as float32
MIXED = """
    import torch
    from torch import nn

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 3, "precision": "bf16-mixed"}
    FLOAT32_STREAM = False


    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.norm(torch.tanh(self.linear(h)))


    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
            self.blocks = nn.Sequential(*[Block() for _ in range(4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            return self.head(self.blocks(h.float() if FLOAT32_STREAM else h))


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return Net()
""" + FROZEN_BACKBONE[FROZEN_BACKBONE.index("    def example_inputs") :].replace(
    # SGD: an update in proportion to its gradient, so bf16's rounding shows in proportion too (Adam's
    # steps are lr-sized whatever the gradient: a near-zero one that rounds across 0 moves by 2 lr)
    "torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)",
    "torch.optim.SGD(params, lr=0.1, momentum=0.9)",
)


def one_thread_reference(front: FrontEnd, workflow: Workflow) -> dict[str, torch.Tensor]:
    """The plain loop with one torch thread, as each function computes: bf16 results depend on how
    a reduction is split among threads (by a bf16 rounding: 1e-3 on this model), float32's hardly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference_training(front, workflow, workflow.regions[0].name)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["bf16", "float32"])
def test_bf16_mixed_trains_in_a_replicated_pipeline_as_a_bf16_plain_loop(stream: str, tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MIXED).replace("FLOAT32_STREAM = False", f"FLOAT32_STREAM = {stream == 'float32'}"))
    front = run_front_end(FrontEndOptions(path, profile_repeats=0))
    last = len(front.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        front, build, [(0, last // 2, 2), (last // 2 + 1, last, 2)], micro_batch=2, global_batch=8, iterations=3
    )
    assert workflow.run.precision == "bf16-mixed"
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(path), "-q", "--keep-storage"]) == 0
    params = load_file(out / "model.safetensors")
    assert all(value.dtype == torch.float32 for value in params.values())  # float32 master weights
    expected = one_thread_reference(front, workflow)
    in_float32 = one_thread_reference(
        front, dataclasses.replace(workflow, run=dataclasses.replace(workflow.run, precision="32-true"))
    )
    # a bf16 activation crosses as it is: the plain loop's numbers; a float32 one is rounded to bf16
    # on the way, which the plain loop does not do: within bf16's precision of it
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if stream == "bf16" else {"rtol": 1.6e-2, "atol": 5e-3}
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], **tolerance, msg=name)
    assert any(not torch.allclose(in_float32[n], expected[n], atol=1e-4) for n in params)  # bf16 did matter
    # what crossed the boundary: bf16 on the wire, given back in the stage's own dtype
    (run_id,) = [p.name for p in (out / "storage").iterdir() if p.name.startswith("run-")]
    namespace = protocol.namespace(run_id, workflow.regions[0].name)
    storage = DirectoryChannel(out / "storage")
    for key in (protocol.activation_key(namespace, 2, 0, 0), protocol.gradient_key(namespace, 2, 1, 0)):
        sent = storage.get(key)
        header = json.loads(sent[8 : 8 + int.from_bytes(sent[:8], "little")].decode())
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}, key
        given = {v.dtype for v in unpack(sent).values() if isinstance(v, torch.Tensor)}
        assert given == {torch.float32 if stream == "float32" else torch.bfloat16}, key


def test_values_sent_narrow_come_back_in_their_own_dtype_and_others_untouched() -> None:
    values = {
        "stream": torch.linspace(-1, 1, 1000, dtype=torch.float32) / 3,
        "already": torch.tensor([0.5, 3.0], dtype=torch.bfloat16),
        "ids": torch.tensor([1, 2]),
        "flag": True,
    }
    narrow = pack(values, torch.bfloat16)
    assert len(pack(values)) - len(narrow) > 1900  # 2 of its 4 bytes per value
    back = unpack(narrow)
    assert back["stream"].dtype == torch.float32 and back["already"].dtype == torch.bfloat16
    assert torch.equal(back["stream"], values["stream"].to(torch.bfloat16).float())  # rounded once
    assert torch.equal(back["ids"], values["ids"]) and back["flag"] is True
    assert torch.equal(unpack(pack(values))["stream"], values["stream"])  # not narrowed: exact


def test_bf16_mixed_plans_with_the_bytes_a_stage_sends(tmp_path: Path) -> None:
    """Under bf16-mixed the cuts carry every floating activation in bf16: half a float32 model's
    bytes; the first stage's input is the staged data, read as stored."""
    fronts = {}
    for stream in ("32-true", "bf16-mixed"):
        path = tmp_path / f"{stream}.py"
        text = textwrap.dedent(MIXED).replace("FLOAT32_STREAM = False", "FLOAT32_STREAM = True")
        path.write_text(text.replace('"bf16-mixed"', repr(stream)))
        fronts[stream] = run_front_end(FrontEndOptions(path, profile_repeats=0))
    full, mixed = fronts["32-true"].chain.blocks, fronts["bf16-mixed"].chain.blocks
    assert [b.output_bytes for b in mixed[:-1]] == [b.output_bytes // 2 for b in full[:-1]]
    assert mixed[0].input_bytes == full[0].input_bytes > 0


def test_clipping_is_planned_with_its_norm_exchange(tmp_path: Path) -> None:
    from cloudless.compiler.planner.plan import PlanOptions, build_problem

    path = tmp_path / "model.py"
    for text, clipped in ((CLIPPED, True), (CLIPPED.replace(', "max_grad_norm": 0.05', ""), False)):
        path.write_text(textwrap.dedent(text))
        front = run_front_end(FrontEndOptions(path, profile_repeats=1))
        _, problem = build_problem(front.chain, front.model_file, PlanOptions())
        assert problem.clipped is clipped
