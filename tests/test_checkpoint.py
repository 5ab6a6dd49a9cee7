"""Fine-tuning from a checkpoint: a model file whose build_model() loads a local `from_pretrained` folder
trains from exactly those weights, in a replicated pipeline, as a plain PyTorch loop from the same folder."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cloudless.compiler.cli import main as compile_main
from cloudless.compiler.pipeline import FrontEndOptions, run_front_end
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.control.staged_weights import stage_weights
from cloudless.runtimes.control.staging import load_model_module
from cloudless.runtimes.function.initial_weights import package_weights
from cloudless.runtimes.storage.channels import DirectoryChannel
from tests.runtime_cases import reference_training, write_packages

transformers = pytest.importorskip("transformers")

MODEL = """
    import torch
    import transformers
    from pathlib import Path
    from torch import nn

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 3, "learning_rate": 0.05}
    CHECKPOINT = Path(__file__).parent / "pretrained"


    def build_model() -> nn.Module:
        model = transformers.LlamaForCausalLM.from_pretrained(CHECKPOINT)
        model.config.use_cache = False
        return model


    def example_inputs(batch_size: int):
        return (torch.randint(0, 64, (batch_size, 12), generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, 64, (batch_size, 12), generator=torch.Generator().manual_seed(1))


    def loss_fn(output, target):
        return nn.functional.cross_entropy(output.logits.reshape(-1, 64), target.reshape(-1))


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


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["package", "staged"])
def test_a_model_loaded_from_a_pretrained_folder_trains_from_its_weights_as_plain_pytorch(
    tmp_path: Path, weights: str
) -> None:
    """`staged`: the build holds no parameter weights; the run stages them from build_model(), which
    loads the folder with the parameters moved into files as they are registered."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(7)
    pretrained = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # weights no seeded initialisation gives: only the folder holds them
        for p in pretrained.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    pretrained.save_pretrained(tmp_path / "pretrained")
    saved = load_file(tmp_path / "pretrained" / "model.safetensors")
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODEL))
    front = run_front_end(FrontEndOptions(path, profile_repeats=0, stand_ins=weights == "staged"))
    last = len(front.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        front, build, [(0, last // 2, 2), (last // 2 + 1, last, 2)], micro_batch=2, global_batch=8, iterations=3
    )
    # the build starts from the folder's weights: in its packages, or staged from build_model()
    region = workflow.regions[0]
    storage = DirectoryChannel(tmp_path / "staged")
    stage_weights(load_model_module(path), [region], {region.name: (storage, "run/r")})
    staged = {}
    for function in region.functions:
        in_package = load_file(build / function.package / "weights.safetensors")
        assert bool(set(in_package) & set(saved)) == (weights == "package")
        staged.update(package_weights(build / function.package, function, storage, "run/r", 5))
    assert set(saved) <= set(staged)
    for name, value in saved.items():
        torch.testing.assert_close(staged[name], value, rtol=0, atol=0, msg=name)
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(path), "-q"]) == 0
    if weights == "staged":  # one shard per stage, as transformers writes a big checkpoint, and its index
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        ]  # fmt: skip
        params = {}
        for shard in sorted(set(index["weight_map"].values())):
            params.update(load_file(out / shard))
        assert sorted(params) == sorted(index["weight_map"])
        assert not (out / "model.safetensors").exists()
    else:
        params = load_file(out / "model.safetensors")
    expected = reference_training(front, workflow, workflow.regions[0].name)
    assert params.keys() == expected.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(params[name], saved[name]) for name in saved if name in params)
    # the trained model loads back into the user's class, as a checkpoint of it
    trained = transformers.LlamaForCausalLM(config)
    missing, unexpected = trained.load_state_dict(params, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(params)


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        (3, "the checkpoint has no 'model.layers.2.input_layernorm.weight' (9 key(s) of the model it lacks"),
        (1, "the model has no 'model.layers.1.input_layernorm.weight' (9 key(s) of the checkpoint it does not use)"),
    ],
)
def test_a_checkpoint_that_does_not_match_the_model_is_one_line_naming_the_key(
    tmp_path: Path, capsys, layers: int, expected: str
) -> None:
    """transformers would load what matches and start the rest from random values (only logging it)."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "pretrained")
    path = tmp_path / "model.py"
    source = textwrap.dedent(MODEL).replace(
        "from_pretrained(CHECKPOINT)", f"from_pretrained(CHECKPOINT, num_hidden_layers={layers})"
    )
    path.write_text(source)
    line = next(n for n, text in enumerate(source.splitlines(), 1) if "from_pretrained" in text)
    assert compile_main([str(path), "-o", str(tmp_path / "build"), "--repeats", "0", "-q"]) == 2
    # transformers' own progress bars go to stderr before it: the compiler's is one line
    ours = [text for text in capsys.readouterr().err.splitlines() if "cloudless-compile" in text]
    assert len(ours) == 1, ours
    error = ours[0]
    assert error.startswith(f"cloudless-compile: error: {path}:{line}: build_model() raised CheckpointMismatch: ")
    assert f"from_pretrained('{tmp_path / 'pretrained'}'): {expected}" in error
    assert not (tmp_path / "build").exists()
