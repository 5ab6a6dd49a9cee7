"""Library ops: an operator a library registers (torch.library.custom_op), which a traced model calls,
resolves in the function: the stage imports the module registering it, the package installs the
library; what passes the compile and --check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cloudless.codegen.libraries import (
    UserImportError,
    import_lines,
    library_ops,
    third_party_imports,
    unimported_classes,
    unregistered_ops,
)
from cloudless.codegen.library_objects import REBUILD_SOURCE, LibraryObjects
from cloudless.codegen.validate import BuildCheckError, check_build
from cloudless.compiler.errors import CompileError
from cloudless.compiler.frontend.verify import check_library_ops_resolve
from cloudless.compiler.pipeline import FrontEndOptions, run_front_end
from cloudless.runtimes.cli import main as run_main
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
@pytest.mark.parametrize("experts", ["default", "eager"])
def test_mixtral_trains_in_a_replicated_pipeline_as_plain_pytorch(compile_cli, tmp_path: Path, experts: str) -> None:
    """Default experts call the grouped_mm op transformers registers; eager experts loop over the experts a
    batch hits (no graph), so each experts module runs as the library's code, rebuilt in its stage."""
    path = tmp_path / "model.py"
    source = textwrap.dedent(MIXTRAL)
    if experts == "eager":
        source = source.replace("use_cache=False,", 'use_cache=False, experts_implementation="eager",')
    path.write_text(source)
    front = run_front_end(FrontEndOptions(path, profile_repeats=0))
    last = len(front.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        front, build, [(0, last // 2, 2), (last // 2 + 1, last, 2)], micro_batch=2, global_batch=8, iterations=3
    )
    sources = {f.package: (build / f.package / "stage.py").read_text() for f in workflow.regions[0].functions}
    marker = "torch.ops.transformers.grouped_mm_fallback" if experts == "default" else "# defines MixtralExperts"
    assert all(marker in source for source in sources.values())
    for package, source in sources.items():
        assert unregistered_ops(source) == [] and unimported_classes(source) == [], package
        requirements = (build / package / "requirements-libraries.txt").read_text()
        assert f"transformers=={__import__('transformers').__version__}\n" in requirements
        assert "requirements-libraries.txt" in (build / package / "Dockerfile").read_text()
        assert "transformers==" in (build / package / "requirements.txt").read_text()
    # every op resolves and every library module builds in a fresh interpreter, and the run (fresh
    # processes) trains as plain PyTorch
    check_library_ops_resolve(sorted(sources.items()))
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(path), "-q"]) == 0
    params = load_file(out / "model.safetensors")
    expected = reference_training(front, workflow, workflow.regions[0].name)
    assert params.keys() == expected.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert json.loads((out / "metrics.json").read_text())["status"] == "done"
    # compiled: the build passes --check; a stage that lost its import fails it, before any function starts
    compiled = tmp_path / "compiled"
    code, _, stderr = compile_cli(str(path), "-o", str(compiled), "--repeats", "1", "-q")
    assert code == 0, stderr
    check_build(compiled)
    stage = next(compiled.glob("regions/*/functions/*/stage.py"))
    stage.write_text(
        "\n".join(
            line
            for line in stage.read_text().splitlines()
            if "# registers" not in line and "# defines MixtralExperts" not in line
        )
    )
    wanted = r"calls torch\.ops\.transformers" if experts == "default" else r"rebuilds transformers\.models\.mixtral"
    with pytest.raises(BuildCheckError, match=r"stage\.py: key \(imports\): " + wanted):
        check_build(compiled)


#: a package installed as pip installs one (its code and a dist-info), with a module whose forward loops
#: over the experts its input picks (a data-dependent loop: no graph), takes a keyword argument and
#: returns a tuple; its attributes hold a number, a string, a dtype, a function and a child module
ROUTED_PACKAGE = """
    import torch
    from torch import nn


    class Routed(nn.Module):
        def __init__(self, width: int, experts: int) -> None:
            super().__init__()
            self.gate = nn.Linear(width, experts)
            self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
            self.scale, self.label, self.dtype, self.act = 0.5, "routed", torch.float32, torch.tanh

        def forward(self, x, *, temperature=1.0):
            probs = torch.softmax(self.gate(x) / temperature, -1)
            choice = probs.argmax(-1)
            out = torch.zeros_like(x)
            for e in choice.unique():
                rows = (choice == e).nonzero().squeeze(1)
                out = out.index_add(0, rows, self.act(self.experts[int(e)](x[rows])) * probs[rows, int(e)][:, None])
            return out * self.scale, choice
"""

ROUTED_MODEL = """
    import torch
    from torch import nn

    from routedlib.moe import Routed

    TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [4], "iterations": 3, "learning_rate": 0.1}


    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.routed, self.b = nn.Linear(6, 8), Routed(8, 3), nn.Linear(8, 3)

        def forward(self, x):
            h, _ = self.routed(torch.relu(self.a(x)), temperature=2.0)
            return self.b(h)


    def build_model() -> nn.Module:
        torch.manual_seed(0)
        return Net()


    def example_inputs(batch_size: int):
        return (torch.randn(batch_size, 6, generator=torch.Generator().manual_seed(0)),)


    def example_targets(batch_size: int):
        return torch.randint(0, 3, (batch_size,), generator=torch.Generator().manual_seed(1))


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


def _install_routedlib(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """routedlib 0.1, installed into `site` (on sys.path here and in the run's function processes)."""
    (site / "routedlib").mkdir(parents=True)
    (site / "routedlib" / "__init__.py").write_text("")
    (site / "routedlib" / "moe.py").write_text(textwrap.dedent(ROUTED_PACKAGE))
    info = site / "routedlib-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: routedlib\nVersion: 0.1\n")
    (info / "top_level.txt").write_text("routedlib\n")
    (info / "RECORD").write_text("routedlib/__init__.py,,\nroutedlib/moe.py,,\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", str(site))


@pytest.mark.slow
def test_a_library_module_with_a_data_dependent_loop_runs_as_its_own_code_and_trains_as_plain_pytorch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_routedlib(tmp_path / "site", monkeypatch)
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(ROUTED_MODEL))
    front = run_front_end(FrontEndOptions(path, profile_repeats=0))
    routed = [n for n in front.program.module.graph.nodes if n.op == "call_module"]
    assert [str(n.target) for n in routed] == ["routed"] and routed[0].kwargs == {"temperature": 2.0}
    last = len(front.chain.blocks) - 1
    build = tmp_path / "build"
    workflow = write_packages(
        front, build, [(0, last // 2, 2), (last // 2 + 1, last, 2)], micro_batch=4, global_batch=8, iterations=3
    )
    sources = [(f.package, (build / f.package / "stage.py").read_text()) for f in workflow.regions[0].functions]
    (holder,) = [source for _, source in sources if "_rebuild(" in source]
    assert "import routedlib.moe  # defines Routed" in holder
    assert "'scale': 0.5, 'label': 'routed', 'dtype': torch.float32, 'act': torch.tanh" in holder
    assert "'routed.experts.2.weight': ((8, 8), 'float32', 'parameter')" in holder
    assert "routedlib==0.1" in (build / workflow.regions[0].functions[0].package / "requirements.txt").read_text() or (
        "routedlib==0.1" in "".join((build / p / "requirements.txt").read_text() for p, _ in sources)
    )
    check_library_ops_resolve(sources)
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(path), "-q"]) == 0
    params = load_file(out / "model.safetensors")
    expected = reference_training(front, workflow, workflow.regions[0].name)
    assert params.keys() == expected.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    built = front.model_file.build_model().state_dict()
    assert not torch.equal(params["routed.gate.weight"], built["routed.gate.weight"])  # the library's code trained
    assert any(
        not torch.equal(params[f"routed.experts.{e}.weight"], built[f"routed.experts.{e}.weight"]) for e in range(3)
    )


def test_a_data_dependent_loop_in_the_models_own_folder_is_one_error_naming_the_line_and_fix(
    compile_cli, tmp_path: Path
) -> None:
    (tmp_path / "mine.py").write_text(textwrap.dedent(ROUTED_PACKAGE))
    (tmp_path / "model.py").write_text(textwrap.dedent(ROUTED_MODEL).replace("from routedlib.moe", "from mine"))
    code, _, stderr = compile_cli(str(tmp_path / "model.py"), "-o", str(tmp_path / "build"))
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert "for e in choice.unique()" in stderr and "installed package" in stderr, stderr
    assert not (tmp_path / "build").exists()


def test_a_library_module_is_rebuilt_from_literals_and_what_cannot_be_written_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_routedlib(tmp_path / "site", monkeypatch)
    from routedlib.moe import Routed

    module = Routed(4, 2)
    objects = LibraryObjects()
    expression = objects.module(module, "net.routed")
    assert objects.import_lines() == [
        "import routedlib.moe  # defines Routed",
        "import torch",
        "import torch.nn.modules.container",
        "import torch.nn.modules.linear",
    ]
    namespace: dict[str, object] = {"torch": torch, "routedlib": __import__("routedlib.moe")}
    exec(REBUILD_SOURCE, namespace)
    rebuilt = eval(expression, namespace)
    assert type(rebuilt) is Routed and type(rebuilt.experts) is torch.nn.ModuleList
    assert (rebuilt.scale, rebuilt.label, rebuilt.dtype, rebuilt.act) == (0.5, "routed", torch.float32, torch.tanh)
    assert dict(rebuilt.named_parameters()) == {}  # its tensors are the stage's, loaded from the weights
    rebuilt.load_state_dict(module.state_dict(), strict=False, assign=True)
    module.act = lambda x: x
    with pytest.raises(ValueError, match=r"net\.routed\.act: .*cannot be imported by name"):
        LibraryObjects().module(module, "net.routed")
    module.act, module.table = torch.tanh, torch.ones(2)
    with pytest.raises(ValueError, match=r"net\.routed\.table is a tensor that is neither a parameter nor a buffer"):
        LibraryObjects().module(module, "net.routed")
    del module.table
    module.register_forward_hook(lambda *_: None)
    with pytest.raises(ValueError, match=r"net\.routed has forward hooks"):
        LibraryObjects().module(module, "net.routed")


def test_the_third_party_modules_the_users_code_imports_in_the_function_are_found_by_scope() -> None:
    """What a function imports of the model file: what it and its neighbours import as they load, and what
    transform and collate_fn (and the model file's functions they call) import; not what only the
    compiling machine runs (build_model, load_shard and their helpers)."""
    model = textwrap.dedent(
        """
        import json, torch
        from torch import nn
        import helpers
        from . import nothing
        try:
            import not_installed_anywhere
        except ImportError:
            not_installed_anywhere = None

        def write_shards():
            import sklearn.datasets

        def load_shard(region, split):
            write_shards()

        def decode(data):
            from PIL import Image
            return Image

        def transform(sample, *, epoch, index):
            return decode(sample)

        class Padding:
            def __call__(self, samples):
                import yaml
        """
    ).encode()
    helpers = b"def scale():\n    import numpy\n"
    modules = third_party_imports({"model.py": model, "helpers.py": helpers}, "model.py")
    assert modules == ["PIL", "numpy", "torch", "yaml"]  # torch too: the images install it anyway
    # an import this machine cannot resolve, outside a try: its file and line
    with pytest.raises(UserImportError, match=r"^model\.py:3: imports no_such_module_here, which no package"):
        third_party_imports({"model.py": b"import torch\n\nimport no_such_module_here\n"}, "model.py")


WRAPPED_MODEL = """
import torch
import torch.fx
from torch import nn

from helpers import gate

TRAINING = {"global_batch_size": 16, "micro_batch_sizes": [4], "iterations": 4, "learning_rate": 0.1}


def scale_shift(x, s):
    return x * s + 0.1


# torchvision's way: functions the tracer keeps as calls, whose code stays the user's
torch.fx.wrap("scale_shift")
torch.fx.wrap("gate")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        x = scale_shift(torch.relu(self.a(x)), 0.5)
        return self.c(gate(torch.relu(self.b(x))))


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)


def example_targets(batch_size):
    return torch.zeros(batch_size, dtype=torch.int64)


def load_shard(region, split):
    generator = torch.Generator().manual_seed(1 if split == "train" else 2)
    inputs, targets = torch.randn(64, 16, generator=generator), torch.randint(0, 4, (64,), generator=generator)
    return [((x,), y) for x, y in zip(inputs, targets)]
"""
HELPERS = """
import torch


def gate(x):
    return x * torch.sigmoid(x)
"""


@pytest.mark.slow  # two compiles and a run
def test_stage_code_calls_the_model_files_wrapped_helpers_from_its_package_and_trains_as_plain_pytorch(
    compile_cli, tmp_path: Path
) -> None:
    """A torch.fx.wrap helper of the model file and one of a module beside it stay calls in the stage code,
    found in the package's user/ folder where the stage runs; 2 stages x 2 replicas train as plain PyTorch,
    and the build is the same from another folder."""
    import yaml

    from cloudless.compiler.frontend.model_file import load_model_file
    from cloudless.ir.workflow import Workflow
    from tests.reference import plain_training

    builds = []
    for where in ("one", "two"):
        folder = tmp_path / where
        folder.mkdir()
        (folder / "model.py").write_text(textwrap.dedent(WRAPPED_MODEL))
        (folder / "helpers.py").write_text(textwrap.dedent(HELPERS))
        build = folder / "build"
        # the second from the first's profile (the same plan whatever the machine's noise), in a process of its
        # own, as a user's (this one holds the first folder's `helpers` module)
        profile = ("--profile", str(builds[0] / "ir" / "blocks.json")) if builds else ("--repeats", "1")
        options = (str(folder / "model.py"), "-o", str(build), "--stages", "2", "--replicas", "2", *profile)
        if not builds:
            code, _, stderr = compile_cli(*options)
        else:
            cli = "import sys; from cloudless.compiler.cli import main; sys.exit(main(sys.argv[1:]))"
            done = subprocess.run([sys.executable, "-c", cli, *options], capture_output=True, text=True, check=False)
            code, stderr = done.returncode, done.stderr
        assert code == 0, stderr
        builds.append(build)
    stages = {p.parent.name: p.read_text() for p in builds[0].glob("regions/*/functions/*/stage.py")}
    calls = "\n".join(stages.values())
    assert "user_scale_shift = user_attribute('model.py', 'scale_shift')" in calls
    assert "user_gate = user_attribute('model.py', 'gate', module='helpers')" in calls
    for package in builds[0].glob("regions/*/functions/*/"):
        assert (package / "user" / "model.py").is_file() and (package / "user" / "helpers.py").is_file()
    again = {p.parent.name: p.read_text() for p in builds[1].glob("regions/*/functions/*/stage.py")}
    assert again == stages  # no path or process hash in the code
    out = tmp_path / "out"
    model = tmp_path / "one" / "model.py"
    assert run_main([str(builds[0]), "--out", str(out), "--model", str(model), "-q"]) == 0
    workflow = Workflow.from_json(yaml.safe_load((builds[0] / "workflow.yaml").read_text()))
    assert [f.replicas for f in workflow.regions[0].functions] == [2, 2]
    expected = plain_training(load_model_file(model), workflow, workflow.regions[0].name)
    trained = load_file(out / "model.safetensors")
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_only_the_model_files_folder_is_the_users_code_not_torch_nor_a_package_installed_below_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model file at a project's root, its virtual environment below it: torch and the installed packages
    stay what they are (imported by the image), and only the modules of the folder are shipped as the user's."""
    import importlib

    from cloudless.codegen.stage_source import _user_module

    installed = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages"
    installed.mkdir(parents=True)
    (installed / "fakelib_for_test.py").write_text("def f():\n    return 1\n")
    (tmp_path / "helper_for_test.py").write_text("def g():\n    return 2\n")
    (tmp_path / "model.py").write_text("")
    monkeypatch.syspath_prepend(str(installed))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fakelib_for_test", "helper_for_test"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        importlib.import_module(name)
    model = str(tmp_path / "model.py")
    assert _user_module("helper_for_test", model) == "helper_for_test"
    assert _user_module("fakelib_for_test", model) is None
    assert _user_module("torch.nn.functional", model) is None and _user_module("math", model) is None
    assert _user_module("helper_for_test", None) is None
