"""Library ops: an operator a library registers (torch.library.custom_op), which a traced model calls,
resolves in the function: the stage imports the module registering it, the package installs the
library; what passes the compile and --check runs in a fresh interpreter."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cloudless.codegen.libraries import import_lines, library_ops, unregistered_ops
from cloudless.codegen.validate import BuildCheckError, check_build
from cloudless.compiler.errors import CompileError
from cloudless.compiler.pipeline import FrontEndOptions, run_front_end
from cloudless.compiler.verify import check_library_ops_resolve
from cloudless.runtimes.run import main as run_main
from tests.runtime_cases import reference_training, write_packages

GROUPED_MM = "torch.ops.transformers.grouped_mm_fallback.default(x, w, offs)"


def test_a_stage_calling_a_library_op_imports_the_module_that_registers_it() -> None:
    pytest.importorskip("transformers.integrations.moe")
    assert library_ops(f"y = {GROUPED_MM}\nz = torch.ops.aten.mm.default(y, y)") == [
        "transformers::grouped_mm_fallback"
    ]
    (line,) = import_lines(f"y = {GROUPED_MM}")
    assert line == "import transformers.integrations.moe  # registers torch.ops.transformers.grouped_mm_fallback"
    assert unregistered_ops(f"y = {GROUPED_MM}") == ["torch.ops.transformers.grouped_mm_fallback"]
    assert unregistered_ops(f"{line}\ny = {GROUPED_MM}") == []


def test_the_fresh_interpreter_check_finds_an_op_nothing_imported_registers() -> None:
    """This process has transformers imported (the op resolves here); a function would not."""
    pytest.importorskip("transformers.integrations.moe")
    source = f"import torch\n\n\ndef forward(x, w, offs):\n    return {GROUPED_MM}\n"
    with pytest.raises(CompileError, match=r"fresh interpreter.*stage 0 of 1: AttributeError: .*grouped_mm_fallback"):
        check_library_ops_resolve([("stage 0 of 1", source)])


LOCAL_OP = """
    import torch
    from torch import nn

    import local_ops

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 2}


    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.ops.cloudless_test.twice(self.a(x)))


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return Net()


    def example_inputs(batch_size: int):
        return (torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, 2, (batch_size,), generator=torch.Generator().manual_seed(1))
"""

LOCAL_OPS_MODULE = """
    import torch


    @torch.library.custom_op("cloudless_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2


    @twice.register_fake
    def _(x):
        return torch.empty_like(x)


    twice.register_autograd(lambda ctx, grad: grad * 2)
"""


def test_an_op_registered_in_the_models_own_folder_is_one_error_naming_the_fix(compile_cli, tmp_path: Path) -> None:
    (tmp_path / "local_ops.py").write_text(textwrap.dedent(LOCAL_OPS_MODULE))
    (tmp_path / "model.py").write_text(textwrap.dedent(LOCAL_OP))
    code, _, stderr = compile_cli(str(tmp_path / "model.py"), "-o", str(tmp_path / "build"))
    assert code == 2
    assert stderr.count("\n") == 1 and "torch.ops.cloudless_test.twice" in stderr, stderr
    assert "local_ops.py, which no installed package provides" in stderr and "Fix: " in stderr
    assert not (tmp_path / "build").exists()


MIXTRAL = """
    import torch
    import transformers
    from torch import nn

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 3}


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        config = transformers.MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
            use_cache=False,
        )
        return transformers.MixtralForCausalLM(config)


    def example_inputs(batch_size: int):
        return (torch.randint(0, 64, (batch_size, 16), generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, 64, (batch_size, 16), generator=torch.Generator().manual_seed(1))


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
def test_mixtral_with_its_grouped_mm_op_trains_in_a_replicated_pipeline_as_plain_pytorch(
    compile_cli, tmp_path: Path
) -> None:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MIXTRAL))
    front = run_front_end(FrontEndOptions(path, profile_repeats=0))
    last = len(front.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        front, build, [(0, last // 2, 2), (last // 2 + 1, last, 2)], micro_batch=2, global_batch=8, iterations=3
    )
    sources = {f.package: (build / f.package / "stage.py").read_text() for f in workflow.regions[0].functions}
    assert any("torch.ops.transformers.grouped_mm_fallback" in source for source in sources.values())
    for package, source in sources.items():
        assert unregistered_ops(source) == [], package
        if library_ops(source):
            requirements = (build / package / "requirements-libraries.txt").read_text()
            assert f"transformers=={__import__('transformers').__version__}\n" in requirements
            assert "requirements-libraries.txt" in (build / package / "Dockerfile").read_text()
            assert "transformers==" in (build / package / "requirements.txt").read_text()
    # every op resolves in a fresh interpreter, and the run (fresh processes) trains as plain PyTorch
    check_library_ops_resolve(sorted(sources.items()))
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(path), "-q"]) == 0
    params = load_file(out / "model.safetensors")
    expected = reference_training(front, workflow, workflow.regions[0].name)
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert json.loads((out / "metrics.json").read_text())["status"] == "done"
    # compiled: the build passes --check; a stage that lost its import fails it, before any function starts
    compiled = tmp_path / "compiled"
    code, _, stderr = compile_cli(str(path), "-o", str(compiled), "--repeats", "1", "-q")
    assert code == 0, stderr
    check_build(compiled)
    stage = next(p for p in compiled.glob("regions/*/functions/*/stage.py") if library_ops(p.read_text()))
    stage.write_text("\n".join(line for line in stage.read_text().splitlines() if "# registers" not in line))
    with pytest.raises(BuildCheckError, match=r"stage\.py: key \(imports\): calls torch\.ops\.transformers"):
        check_build(compiled)
