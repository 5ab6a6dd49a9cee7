"""Bad model files: one clear line naming the file (and line), exit 2, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

GOOD_TAIL = """
def example_inputs(batch_size):
    return (torch.randn(batch_size, 4),)
"""

CASES = {
    "syntax": ("import torch\ndef build_model(:\n    pass\n", r"model.py:2: syntax error"),
    "import": (
        "import torch\nimport not_a_real_module_xyz\n",
        r"model.py:2: importing the model file failed: ModuleNotFoundError: No module named 'not_a_real_module_xyz'",
    ),
    "raises_at_import": (
        "import torch\nx = 1\nraise ValueError('bad config')\n",
        r"model.py:3: importing .*ValueError: bad config",
    ),
    "no_build_model": ("import torch\n" + GOOD_TAIL, r"model.py: no function build_model\(\)"),
    "no_example_inputs": (
        "import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n",
        r"model.py: no function example_inputs\(\)",
    ),
    "not_callable": (
        "import torch\nbuild_model = 3\n" + GOOD_TAIL,
        r"model.py: build_model is int; expected a function",
    ),
    "wrong_model_type": (
        "import torch\ndef build_model():\n    return [1, 2]\n" + GOOD_TAIL,
        r"model.py: build_model\(\) returned list; expected a torch.nn.Module",
    ),
    "inputs_not_tuple": (
        "import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
        "def example_inputs(batch_size):\n    return torch.randn(batch_size, 4)\n",
        r"model.py: example_inputs\(2\) returned Tensor; expected a non-empty tuple of tensors",
    ),
    "inputs_not_tensors": (
        "import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
        "def example_inputs(batch_size):\n    return ([1, 2],)\n",
        r"model.py: example_inputs\(2\) holds int; expected only tensors",
    ),
    "build_model_raises": (
        "import torch\ndef build_model():\n    width = 4\n    raise RuntimeError('no weights')\n" + GOOD_TAIL,
        r"model.py:4: build_model\(\) raised RuntimeError: no weights",
    ),
    "bad_training": (
        "import torch\nTRAINING = {'iterations': 'ten'}\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
        + GOOD_TAIL,
        r"model.py: TRAINING\['iterations'\] is str; expected int",
    ),
    "no_parameters": (
        "import torch\nclass Double(torch.nn.Module):\n    def forward(self, x):\n        return 2 * x\n"
        "def build_model():\n    return Double()\n" + GOOD_TAIL,
        r"model.py: build_model\(\) returned a Double with no trainable parameters; there is nothing to train",
    ),
    "inputs_do_not_fit": (
        "import torch\ndef build_model():\n    return torch.nn.Linear(5, 2)\n" + GOOD_TAIL,
        r"model.py: the example inputs do not fit the model: .*example_inputs\(2\) \(float32\[2, 4\]\) raised "
        r"RuntimeError: mat1 and mat2 shapes cannot be multiplied",
    ),
    "input_dtype_does_not_fit": (
        "import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 2)\n    def forward(self, x):\n        return self.fc(x)\n"
        "def build_model():\n    return Net()\n"
        "def example_inputs(batch_size):\n    return (torch.ones(batch_size, 4, dtype=torch.long),)\n",
        r"model.py:7: the example inputs do not fit the model: .*\(int64\[2, 4\]\) raised RuntimeError: ",
    ),
    "exits_at_import": (
        "import sys\nimport torch\nsys.exit(3)\n",
        r"model.py:3: called sys.exit\(3\) while importing the model file; a model file must not exit",
    ),
    "build_model_exits": (
        "import sys\nimport torch\ndef build_model():\n    sys.exit(3)\n" + GOOD_TAIL,
        r"model.py:4: called sys.exit\(3\) in build_model\(\); a model file must not exit",
    ),
    "exit_with_a_message": (
        "import torch\ndef build_model():\n    raise SystemExit('no GPU here')\n" + GOOD_TAIL,
        r"model.py:3: called sys.exit\('no GPU here'\) in build_model\(\); a model file must not exit",
    ),
    "unknown_training_key": (
        "import torch\nTRAINING = {'iters': 3}\ndef build_model():\n    return torch.nn.Linear(4, 2)\n" + GOOD_TAIL,
        r"model.py: TRAINING key 'iters' is unknown",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_model_file_is_one_clear_error(case, model_file, compile_cli, tmp_path: Path) -> None:
    source, expected = CASES[case]
    path = model_file(source)
    out = tmp_path / "build"
    code, stdout, stderr = compile_cli(str(path), "-o", str(out), "--repeats", "0")
    assert code == 2
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("cloudless-compile: error: ")
    import re

    assert re.search(expected, lines[0]), lines[0]
    assert "Traceback" not in stderr
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model.py"]  # no staging folder left behind


@pytest.mark.parametrize("typed", ["absolute", "relative", "dotted"])
def test_messages_name_the_model_file_as_typed(
    typed: str, model_file, compile_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the message comes from a line of the file (a traceback's frame), from a check of what a
    function returned, or from the loss check, it names the file as the command line did."""
    monkeypatch.chdir(tmp_path)
    sources = {
        "a line of it": CASES["build_model_raises"][0],
        "what it returned": CASES["wrong_model_type"][0],
        "the loss check": "import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n" + GOOD_TAIL,
    }
    for what, source in sources.items():
        path = model_file(source)
        shown = {"absolute": str(path), "relative": path.name, "dotted": f"../{tmp_path.name}/{path.name}"}[typed]
        code, _, stderr = compile_cli(shown, "-o", str(tmp_path / "b"), "--repeats", "0")
        assert code == 2, what
        assert stderr.startswith(f"cloudless-compile: error: {shown}:"), (what, stderr)


def test_missing_file(compile_cli, tmp_path: Path) -> None:
    code, _, stderr = compile_cli(str(tmp_path / "absent.py"), "-o", str(tmp_path / "b"))
    assert code == 2
    assert "absent.py: no such file; expected a Python model file" in stderr
    assert not (tmp_path / "b").exists()


def test_failed_compile_keeps_previous_build(model_file, compile_cli, tmp_path: Path) -> None:
    good = model_file(
        "import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
        + GOOD_TAIL
        + "def example_targets(batch_size):\n    return torch.zeros(batch_size, dtype=torch.long)\n",
        "good.py",
    )
    out = tmp_path / "build"
    assert compile_cli(str(good), "-o", str(out), "--repeats", "0", "-q")[0] == 0
    before = (out / "ir" / "graph.json").read_bytes()
    bad = model_file("import torch\nraise SystemError('x')\n", "bad.py")
    assert compile_cli(str(bad), "-o", str(out), "-q")[0] == 2
    assert (out / "ir" / "graph.json").read_bytes() == before


def test_broken_loss_names_its_line(model_file, compile_cli, tmp_path: Path) -> None:
    path = model_file(
        "import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
        + GOOD_TAIL
        + "def example_targets(batch_size):\n    return torch.zeros(batch_size)\n"
        + "def loss_fn(output, target):\n    return output['missing']\n"
    )
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"), "--repeats", "0")
    assert code == 2
    assert "model.py:10: loss_fn(output, target) raised" in stderr


UNTRACEABLE = """
import torch


class Gate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


def build_model():
    return Gate()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 4),)
"""


def test_untraceable_model_names_the_line_and_the_fix(model_file, compile_cli, tmp_path: Path) -> None:
    path = model_file(UNTRACEABLE)
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"))
    assert code == 2
    message = stderr.strip()
    assert "Traceback" not in message
    assert "model.py:12: cannot trace the model at `if x.sum() > 0:`" in message
    assert "torch.where" in message and "--leaf-module" not in message  # a leaf fails the same way: no fix
    assert not (tmp_path / "b").exists()


OPAQUE_OUTPUT = """
import torch


class Box:
    def __init__(self, value):
        self.value = value


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), Box(x)


def build_model():
    return Model()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 4),)


def loss_fn(output, target):
    return output[0].sum()
"""


def test_an_output_torch_cannot_flatten_says_what_to_return(model_file, compile_cli, tmp_path: Path) -> None:
    """A transformers model's cache (use_cache=True) is such an output: the fix says so."""
    code, _, stderr = compile_cli(str(model_file(OPAQUE_OUTPUT)), "-o", str(tmp_path / "b"))
    assert code == 2 and "Traceback" not in stderr
    assert "Fix: return tensors, or tuples, lists, dicts and dataclasses of them" in stderr
    assert "use_cache=False" in stderr and "torch.where" not in stderr
    assert not (tmp_path / "b").exists()


def test_summary_and_quiet(compile_cli, tmp_path: Path) -> None:
    from .conftest import MODELS

    code, stdout, stderr = compile_cli(str(MODELS / "tricky.py"), "-o", str(tmp_path / "a"), "--repeats", "1")
    assert code == 0, stderr
    for label in ("nodes", "blocks", "parameters", "forward", "measured", "time", "wrote"):
        assert f"  {label}" in stdout
    assert "parameters  2,176" in stdout
    code, stdout, stderr = compile_cli(str(MODELS / "tricky.py"), "-o", str(tmp_path / "b"), "--repeats", "0", "-q")
    assert code == 0 and stdout == "" and stderr == ""
    assert (tmp_path / "b" / "ir" / "graph.json").exists()


@pytest.mark.slow
def test_the_solvers_banner_and_log_print_only_with_verbose(tmp_path: Path) -> None:
    """HiGHS prints its banner from C++ straight to the process's stdout: a fresh process tells."""
    from .conftest import MODELS

    compile_command = [sys.executable, "-m", "cloudless.compiler.cli", str(MODELS / "tricky.py"), "--repeats", "1"]
    plain = subprocess.run([*compile_command, "-o", str(tmp_path / "a")], capture_output=True, text=True, check=True)
    assert "plan  " in plain.stdout and "optimal" in plain.stdout
    assert "HiGHS" not in plain.stdout.replace("HiGHS,", "") and "HiGHS" not in plain.stderr
    verbose = subprocess.run(
        [*compile_command, "-o", str(tmp_path / "b"), "--verbose"], capture_output=True, text=True, check=True
    )
    assert "Running HiGHS" in verbose.stdout


def test_bad_option_values(compile_cli, tmp_path: Path) -> None:
    from .conftest import MODELS

    for quiet in ([], ["-q"]):  # -q quiets the summary, never an error
        code, _, stderr = compile_cli(str(MODELS / "tricky.py"), "-o", str(tmp_path / "a"), "--blocks", "0", *quiet)
        assert code == 2 and "--blocks must be at least 1" in stderr
    for option, value, expected in (
        ("--deadline", "nan", "--deadline nan: expected a positive number"),
        ("--budget", "-1", "--budget -1.0: expected a positive number"),
        ("--solver-time-limit", "0", "--solver-time-limit 0.0: expected a positive number"),
        ("--repeats", "-2", "--repeats -2: expected 0 or more"),
    ):
        code, _, stderr = compile_cli(str(MODELS / "tricky.py"), "-o", str(tmp_path / "a"), option, value, "-q")
        assert code == 2 and stderr.strip() == f"cloudless-compile: error: {expected}", stderr
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("optimizer", ["SGD(params, lr=0.1, momentum=0.9)", "Adam(params)", "AdamW(params, lr=3e-4)"])
def test_the_optimizer_probe_gives_options_its_class_takes(model_file, optimizer: str) -> None:
    """The functions rebuild the optimizer as `torch.optim.<class>(params, **options)`: every option
    recorded must be one the constructor takes (AdamW keeps a default it does not: a worker failed)."""
    import torch

    from cloudless.compiler.frontend.model_file import load_model_file, probe_optimizer

    path = model_file(
        "import torch\n\n"
        "def build_model():\n    return torch.nn.Linear(2, 2)\n\n"
        "def example_inputs(batch_size):\n    return (torch.zeros(batch_size, 2),)\n\n"
        f"def make_optimizer(params):\n    return torch.optim.{optimizer}\n"
    )
    probe = probe_optimizer(load_model_file(path))
    rebuilt = getattr(torch.optim, probe.class_name)([torch.nn.Parameter(torch.zeros(3))], **probe.options)
    assert rebuilt.defaults["lr"] == probe.options["lr"]


def test_no_build_file_holds_a_path_of_the_compiling_machine(compile_cli, tmp_path: Path, monkeypatch) -> None:
    """A build is deployed elsewhere: it records the model file relative to where it was compiled, or
    by its name alone, never as this machine's absolute path (nor the build folder's)."""
    import re

    import yaml

    from .conftest import SAMPLES

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the model file is outside the current folder
    build = tmp_path / "build"
    code, _, stderr = compile_cli(str((SAMPLES / "mlp_digits.py").resolve()), "-o", str(build), "-q", "--repeats", "1")
    assert code == 0, stderr
    # an absolute path: one that starts there, not a relative path that passes through it (../../x)
    machine = re.compile("|".join(rf"(?<![\w.]){re.escape(str(f))}" for f in (SAMPLES.resolve().parent, tmp_path)))
    for path in sorted(p for p in build.rglob("*") if p.is_file() and p.suffix != ".safetensors"):
        found = machine.search(path.read_text(errors="replace"))
        assert found is None, f"{path.relative_to(build)}: {found}"
    recorded = yaml.safe_load((build / "workflow.yaml").read_text())["data"]["model_file"]
    assert not Path(recorded).is_absolute()
    assert (elsewhere / recorded).resolve() == (SAMPLES / "mlp_digits.py").resolve()  # from where it was compiled


WEIGHTED_LOSS = """
import torch
WEIGHTS = torch.{weights}
def build_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)
def example_inputs(batch_size):
    return (torch.randn(batch_size, 4),)
def example_targets(batch_size):
    return torch.arange(batch_size) % 3
def loss_fn(output, target):
    return torch.nn.functional.cross_entropy(output, target, weight=WEIGHTS)
"""


def test_a_loss_holding_a_constant_tensor_writes_it_into_loss_py(model_file, compile_cli, tmp_path: Path) -> None:
    """A class-weight table in loss_fn (a constant of the traced loss) goes into loss.py, which computes
    the model file's loss."""
    import importlib.util

    import torch

    path = model_file(WEIGHTED_LOSS.format(weights="tensor([1.0, 2.0, 0.5])"))
    out = tmp_path / "build"
    code, _, stderr = compile_cli(str(path), "-o", str(out), "--repeats", "1", "--verify", "-q")
    assert code == 0, stderr
    (loss_py,) = out.glob("regions/*/functions/*/loss.py")
    spec = importlib.util.spec_from_file_location("generated_loss", loss_py)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss = module.Stage()
    loss.load_state_dict({}, strict=True)  # how a function loads it: the constant is in the source
    output, target = torch.randn(6, 3), torch.tensor([0, 1, 2, 2, 1, 0])
    expected = torch.nn.functional.cross_entropy(output, target, weight=torch.tensor([1.0, 2.0, 0.5]))
    (value,) = loss(output, target)
    torch.testing.assert_close(value, expected, rtol=0, atol=0)


def test_a_loss_holding_a_large_constant_is_one_error(model_file, compile_cli, tmp_path: Path) -> None:
    source = WEIGHTED_LOSS.format(weights="ones(3)").replace("WEIGHTS = ", "BIG = torch.ones(5000)\nWEIGHTS = ")
    path = model_file(source.replace("weight=WEIGHTS)", "weight=WEIGHTS) + 0 * BIG[target].sum()"))
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"), "--repeats", "1")
    assert code == 2
    assert "loss_fn uses a constant tensor of shape (5000,)" in stderr and "make it a buffer of the model" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


OUTSIDE_RANDOMNESS = """
import random

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * random.random())  # drawn once when traced


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(0)),)


def example_targets(batch_size):
    return torch.randint(0, 3, (batch_size,), generator=torch.Generator().manual_seed(1))
"""


def test_a_split_that_cannot_reproduce_the_model_never_exits_0_and_says_why(
    model_file, compile_cli, tmp_path: Path
) -> None:
    """Verification is on by default: the build is not written; the message names the cause and the fix."""
    path = model_file(OUTSIDE_RANDOMNESS)
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"), "--repeats", "1")
    assert code == 1
    assert stderr.count("\n") == 1
    assert "the one stage does not reproduce the model" in stderr
    assert "Cause: the stages compute other numbers than the model" in stderr and "Python's random" in stderr
    assert "Fix: draw random numbers with torch" in stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "detail, cause",
    [
        ("w: gradient missing in the stages", "Cause: the stages give w no gradient"),
        ("w: gradient unexpected in the stages", "Cause: the stages train w"),
    ],
)
def test_a_gradient_only_one_side_has_is_named_with_its_cause(detail: str, cause: str) -> None:
    from cloudless.compiler.frontend.verify import VerifyReport, _cause_and_fix

    text = _cause_and_fix(VerifyReport(gradient_error=float("inf"), worst_gradient="w", details=[detail]))
    assert text.startswith(cause) and "Fix: " in text and "requires_grad_(False)" in text


def test_the_default_loss_is_named_as_such_with_what_it_needs(model_file, compile_cli, tmp_path) -> None:
    """No loss_fn: the default loss (cross-entropy) is no line of the user's; it needs targets."""
    no_targets = OUTSIDE_RANDOMNESS.replace("* random.random()", "")
    no_targets = no_targets[: no_targets.index("def example_targets")]
    code, _, stderr = compile_cli(str(model_file(no_targets)), "-o", str(tmp_path / "a"), "--repeats", "0")
    assert code == 2 and stderr.count("\n") == 1
    assert "model.py: defines neither loss_fn(output, target) nor example_targets(batch_size)" in stderr
    assert "Fix: define example_targets" in stderr
    wrong_targets = OUTSIDE_RANDOMNESS.replace("* random.random()", "").replace(
        "torch.randint(0, 3, (batch_size,),", "torch.randint(0, 3, (batch_size, 7),"
    )
    code, _, stderr = compile_cli(str(model_file(wrong_targets)), "-o", str(tmp_path / "b"), "--repeats", "0")
    assert code == 2 and stderr.count("\n") == 1
    assert "model.py: the default loss (cross-entropy: the model file defines no loss_fn) raised" in stderr
    assert "Fix: define loss_fn(output, target)" in stderr
