"""What a compile writes is what runs: the stages are traced at the plan's micro-batch, --verify checks
the plan's split at that size (and says so), and the run's length follows TRAINING (iterations, or
epochs of the training data)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml

from cloudless.compiler.errors import CompileError, ModelFileError
from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.compiler.pipeline import FrontEndOptions, retrace, run_front_end
from cloudless.ir.files import load_plan

from .conftest import MODELS

LLAMA = MODELS / "hf_llama_tiny.py"


def wrapper(folder: Path, module: str, training: dict) -> Path:
    """A model file that is `tests/models/<module>.py` with another TRAINING."""
    path = folder / f"{module}_wrapped.py"
    path.write_text(
        textwrap.dedent(
            f"""\
            import sys
            sys.path.insert(0, {str(MODELS)!r})
            from {module} import build_model, example_inputs, example_targets, load_shard, loss_fn, make_optimizer

            TRAINING = {training!r}
            """
        )
    )
    return path


# --- the plan's micro-batch -----------------------------------------------------------------------


@pytest.mark.slow
def test_an_export_model_is_verified_and_built_at_the_plans_micro_batch(compile_cli, tmp_path: Path) -> None:
    """Traced (and profiled) at 2, planned at 4: torch.export baked 2 into the reshapes, so the stages
    are traced again at 4; --verify checks the plan's split at 4 and the summary says so."""
    model = wrapper(tmp_path, "hf_llama_tiny", {"global_batch_size": 8, "micro_batch_sizes": [4], "iterations": 2})
    build = tmp_path / "b"
    code, stdout, stderr = compile_cli(str(model), "-o", str(build), "--batch-size", "2", "--verify", "--repeats", "1")
    assert code == 0, stderr
    assert "traced with torch.export at micro-batch 2" in stdout
    assert re.search(r"micro-batch 4 x 2:", stdout), stdout
    match = re.search(
        r"verified    (\d+) stages? of the plan's split \(blocks [\d| -]+\) at micro-batch 4: "
        r"largest gradient error (\S+) \((\d+) gradients\)",
        stdout,
    )
    assert match, stdout
    assert float(match.group(2)) <= 1e-5 and int(match.group(3)) == 21
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    assert workflow["run"]["micro_batch"] == 4
    assert workflow["run"]["micro_batches"] == 2


BATCH_DEPENDENT = """
import torch
from torch import nn

TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2, 4], "iterations": 1}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if x.shape[0] > 2:  # another graph above 2 rows
            h = torch.relu(h)
        return self.second(h)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 4),)


def example_targets(batch_size: int):
    return torch.zeros(batch_size, dtype=torch.long)
"""


def test_a_model_whose_graph_depends_on_the_batch_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(BATCH_DEPENDENT)
    options = FrontEndOptions(path, batch_size=2, profile_repeats=0, tracer="export")
    front = run_front_end(options)
    with pytest.raises(CompileError) as caught:
        retrace(front, 4, options)
    message = str(caught.value)
    assert "\n" not in message
    assert "the model traces to another graph at micro-batch 4 than at 2" in message
    assert "--batch-size 4" in message


@pytest.mark.slow
def test_stages_with_a_plan_plans_exactly_that_many(compile_cli, tmp_path: Path) -> None:
    model = MODELS / "tricky.py"
    for stages in (1, 3):
        out = tmp_path / f"b{stages}"
        code, stdout, stderr = compile_cli(str(model), "-o", str(out), "--stages", str(stages))
        assert code == 0, stderr
        assert "ignored" not in stderr
        assert len(load_plan(out / "plan.json").stages) == stages
        assert f"{stages} stages (--stages)" in stdout
        assert f"verified    {stages} stage{'s' if stages > 1 else ''} of the plan's split" in stdout
    code, _, stderr = compile_cli(str(model), "-o", str(tmp_path / "b99"), "--stages", "99")
    assert code == 2 and "--stages 99: no plan has that many stages" in stderr, stderr


# --- the run's length -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "training, iterations, source",
    [
        ({"global_batch_size": 8, "iterations": 5}, 5, "TRAINING['iterations']"),
        # 32 training samples (load_shard), 3 passes at 8 a step
        pytest.param(
            {"global_batch_size": 8, "epochs": 3},
            12,
            "TRAINING['epochs'] 3 of 32 samples at global batch 8",
            marks=pytest.mark.slow,
        ),
        # ceil(32 / 12): the third iteration reaches into the next pass
        pytest.param(
            {"global_batch_size": 12, "micro_batch_sizes": [4], "epochs": 1},
            3,
            "TRAINING['epochs'] 1 of 32",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"global_batch_size": 8}, 4, "default: one epoch of 32 samples at global batch 8", marks=pytest.mark.slow
        ),
    ],
)
def test_the_run_length_follows_training_and_the_summary_says_from_where(
    compile_cli, tmp_path: Path, training: dict, iterations: int, source: str
) -> None:
    model = wrapper(tmp_path, "hf_llama_tiny", {"micro_batch_sizes": [2], **training})
    build = tmp_path / "b"
    code, stdout, stderr = compile_cli(str(model), "-o", str(build), "--repeats", "1")
    assert code == 0, stderr
    line = next(line for line in stdout.splitlines() if line.strip().startswith("iterations"))
    assert line.split()[1] == str(iterations) and source in line, line
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    assert workflow["run"]["iterations"] == iterations


def test_epochs_without_data_and_both_lengths_are_errors(model_file, tmp_path: Path) -> None:
    from cloudless.compiler.planner.plan import run_length

    contract = "import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
    contract += "def example_inputs(batch_size):\n    return (torch.randn(batch_size, 4),)\n"
    both = model_file(contract + "TRAINING = {'iterations': 3, 'epochs': 2}\n", "both.py")
    with pytest.raises(ModelFileError, match=r"both\.py: TRAINING gives both 'iterations' and 'epochs'; give one"):
        load_model_file(both)
    zero = model_file(contract + "TRAINING = {'epochs': 0}\n", "zero.py")
    with pytest.raises(ModelFileError, match=r"zero\.py: TRAINING\['epochs'\] is 0; expected at least 1"):
        load_model_file(zero)
    no_data = load_model_file(model_file(contract + "TRAINING = {'epochs': 2}\n", "no_data.py"))
    with pytest.raises(CompileError, match=r"TRAINING\['epochs'\] needs the training data's size"):
        run_length(no_data, None, 8)
    default = run_length(load_model_file(model_file(contract, "plain.py")), None, 8)
    assert default.iterations == 1 and "no load_shard data" in default.source
