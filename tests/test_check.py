"""`cloudless-compile --check BUILD`: a hand-edited build fails with one line naming the file and the key.

Each build is compiled once per module (with its golden block times, so the plan is the golden one) and
copied for each test, which edits the copy the way a user might and runs the CLI on it. The corpus covers
what a run relies on: the workflow agreeing with itself, with plan.json and with every package (function.json,
stage.py, the weights, the loss module), and the manifest's digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloudless.codegen.validate import BuildCheckError, check_build
from cloudless.compiler.cli import main
from cloudless.ir.files import BUILD_MARKER, dump_yaml

from .conftest import MODELS, SAMPLES

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
EAST, WEST = "aws-us-east-1", "aws-eu-west-1"
#: the two builds: a pipeline of two stages of eight replicas (for OpenFaaS Pro: CE allows 5 replicas a
#: function), and two regions averaging their models
BUILDS: dict[str, tuple[Path, str, list[str]]] = {
    "wide": (MODELS / "wide_mlp.py", "wide_mlp_time", ["--objective", "time", "--blocks", "8", "--catalog", "pro"]),
    "geo": (
        SAMPLES / "mlp_digits_geo.py",
        "mlp_digits_geo",
        ["--regions", f"{EAST},{WEST}", "--objective", "time", "--sync", "model-average"],
    ),
}
S0 = f"regions/{EAST}/functions/wide-mlp-s0"
S1 = f"regions/{EAST}/functions/wide-mlp-s1"
GEO_WEST = f"regions/{WEST}/functions/mlp-digits-geo-s0"


def _pro_catalog(folder: Path) -> Path:
    """The default catalog, its regions' OpenFaaS clusters OpenFaaS Pro."""
    document = yaml.safe_load(resources.files("cloudless.ir").joinpath("catalogs", "default.yaml").read_text())
    for region in document["regions"]:
        region["openfaas_edition"] = "pro"
    path = folder / "pro-catalog.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _compile(name: str, output: Path) -> Path:
    model, golden, options = BUILDS[name]
    if "pro" in options:
        options = [str(_pro_catalog(output.parent)) if option == "pro" else option for option in options]
    profile = GOLDEN / golden / "ir" / "blocks.json"
    timing = ["--profile", str(profile)] if profile.exists() else ["--repeats", "1"]
    here = Path.cwd()
    os.chdir(ROOT)  # workflow.yaml records the model's path as given
    try:
        code = main([model.relative_to(ROOT).as_posix(), "-o", str(output), "-q", *timing, *options])
    finally:
        os.chdir(here)
    assert code == 0, f"compiling {name} failed"
    return output


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compiled")
    return {name: _compile(name, root / name) for name in BUILDS}


def copy(compiled: dict[str, Path], name: str, tmp_path: Path) -> Path:
    """A private copy of a compiled build, to break."""
    return Path(shutil.copytree(compiled[name], tmp_path / name))


def check_fails(build: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run `cloudless-compile --check BUILD`: exit status 2 and one line on stderr; returns the message."""
    capsys.readouterr()
    assert main(["--check", str(build)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    prefix = "cloudless-compile: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0].removeprefix(prefix)


# --- edits ------------------------------------------------------------------------------------------------


def replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def edit_workflow(build: Path, change: Callable[[dict[str, Any]], None]) -> None:
    document = yaml.safe_load((build / "workflow.yaml").read_text())
    change(document)
    (build / "workflow.yaml").write_text(dump_yaml(document))


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


def edit_function_json(build: Path, package: str, change: Callable[[dict[str, Any]], None]) -> None:
    edit_json(build / package / "function.json", change)


def function(document: dict[str, Any], name: str, region: int = 0) -> dict[str, Any]:
    return next(f for f in document["regions"][region]["functions"] if f["name"] == name)


def refresh_manifest(build: Path) -> None:
    """Record every listed file's digest anew: an edit the digests cannot see."""
    path = build / BUILD_MARKER
    manifest = json.loads(path.read_text())
    for name in manifest["files"]:
        manifest["files"][name] = "sha256:" + hashlib.sha256((build / name).read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest, indent=1) + "\n")


def weights_with(build: Path, package: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite a package's weights with `change` applied to its tensors (a well-formed file)."""
    from safetensors.torch import load_file, save_file

    path = build / package / "weights.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def set_step_replicas(document: dict[str, Any], function_name: str, replicas: int) -> None:
    for step in document["steps"]:
        if step["function"] == function_name:
            step["replicas"] = replicas


def rename_tensor(stage: Path) -> None:
    replace(stage, "'6.weight': ((1024, 1024)", "'6.weight': ((1024, 512)")


def edit_geo_weight(document: dict[str, Any]) -> None:
    document["regions"][0]["weight"] += 0.25


#: (id, build, edit, the message's start, a phrase it holds)
CORPUS: list[tuple[str, str, Callable[[Path], None], str, str]] = [
    # the weights
    (
        "weights-deleted",
        "wide",
        lambda b: (b / S1 / "weights.safetensors").unlink(),
        f"{S1}/weights.safetensors: key (file): missing",
        "deleted after the compile",
    ),
    (
        "weights-truncated",
        "wide",
        lambda b: truncate(b / S1 / "weights.safetensors", 0.5),
        f"{S1}/weights.safetensors: key (data): truncated",
        "the file holds",
    ),
    (
        "weights-truncated-in-header",
        "wide",
        lambda b: truncate(b / S0 / "weights.safetensors", 0.00002),
        f"{S0}/weights.safetensors: key (header)",
        "safetensors",
    ),
    (
        "weights-byte-flipped",
        "wide",
        lambda b: flip_last_byte(b / S1 / "weights.safetensors"),
        f"{S1}/weights.safetensors: key (digest): differs from cloudless-build.json",
        "recompile",
    ),
    (
        "weights-other-shape",
        "wide",
        lambda b: weights_with(b, S1, lambda t: t.update({"6.bias": t["6.bias"][:512].clone()})),
        f"{S1}/weights.safetensors: key 6.bias: [512] float32, but stage.py's TENSORS declares [1024] float32",
        "edited after the compile",
    ),
    (
        "weights-extra-tensor",
        "wide",
        lambda b: weights_with(b, S0, lambda t: t.update({"extra": t["0.bias"].clone()})),
        f"{S0}/weights.safetensors: key extra: not a tensor of the stage",
        "TENSORS",
    ),
    # stage.py
    (
        "stage-code-edited",
        "wide",
        lambda b: replace(b / S1 / "stage.py", "relu(linear_5, inplace = False)", "gelu(linear_5)"),
        f"{S1}/stage.py: key (digest): differs from cloudless-build.json",
        "recompile",
    ),
    (
        "stage-inputs-edited",
        "wide",
        lambda b: replace(b / S1 / "stage.py", "INPUTS = ('relu_2',)", "INPUTS = ('relu_3',)"),
        f"{S1}/stage.py: key INPUTS: ['relu_3'], but workflow.yaml has ['relu_2']",
        "edited after the compile",
    ),
    (
        "stage-tensors-edited",
        "wide",
        lambda b: rename_tensor(b / S1 / "stage.py"),
        f"{S1}/stage.py: key TENSORS/6.weight: [1024, 512] float32, but weights.safetensors has [1024, 1024]",
        "edited after the compile",
    ),
    (
        "stage-not-python",
        "wide",
        lambda b: replace(b / S0 / "stage.py", "class Stage(", "class Stage(("),
        f"{S0}/stage.py: key (top level): not Python",
        "edited after the compile",
    ),
    (
        "stage-deleted",
        "wide",
        lambda b: (b / S0 / "stage.py").unlink(),
        f"{S0}/stage.py: key (file): missing",
        "the worker runs",
    ),
    # the rest of a package
    (
        "handler-deleted",
        "wide",
        lambda b: (b / S0 / "handler.py").unlink(),
        f"{S0}/handler.py: key (file): missing",
        "entry point",
    ),
    (
        "loss-deleted",
        "wide",
        lambda b: (b / S1 / "loss.py").unlink(),
        f"{S1}/loss.py: key (file): missing: the loss module",
        "deleted after the compile",
    ),
    (
        "vendored-runtime-deleted",
        "wide",
        lambda b: (b / S1 / "cloudless" / "runtimes" / "function" / "worker.py").unlink(),
        f"{S1}/cloudless/runtimes/function/worker.py: key (file): missing",
        "vendored runtime",
    ),
    (
        "package-deleted",
        "wide",
        lambda b: shutil.rmtree(b / S1),
        f"{S1}: key (folder): missing",
        "wide-mlp-s1",
    ),
    (
        "extra-file-in-package",
        "wide",
        lambda b: (b / S0 / "notes.txt").write_text("tried lr 0.1\n"),
        f"{S0}/notes.txt: key (file): not in cloudless-build.json",
        "deployed whole",
    ),
    # function.json
    (
        "function-json-deleted",
        "wide",
        lambda b: (b / S1 / "function.json").unlink(),
        f"{S1}/function.json: key (file): missing",
        "the worker reads",
    ),
    (
        "function-json-micro-batch",
        "wide",
        lambda b: edit_function_json(b, S1, lambda d: d["workflow"]["run"].update(micro_batch=256)),
        f"{S1}/function.json: key workflow/run/micro_batch: 256, but workflow.yaml has 512",
        "the worker reads this copy",
    ),
    (
        "function-json-names-another-function",
        "wide",
        lambda b: edit_function_json(b, S1, lambda d: d.update(function="wide-mlp-s0")),
        f"{S1}/function.json: key function: 'wide-mlp-s0'; expected 'wide-mlp-s1', whose package this is",
        "edited after the compile",
    ),
    (
        "function-json-not-json",
        "wide",
        lambda b: replace(b / S0 / "function.json", "{", "{{"),
        f"{S0}/function.json: key (top level): not JSON",
        "edited after the compile",
    ),
    # workflow.yaml against itself
    (
        "workflow-not-yaml",
        "wide",
        lambda b: replace(b / "workflow.yaml", "run:\n", "run: [\n"),
        "workflow.yaml: key (top level): not plain YAML",
        "",
    ),
    (
        "workflow-unknown-key",
        "wide",
        lambda b: edit_workflow(b, lambda d: d["run"].update(learning_rate=0.1)),
        "workflow.yaml: key run/learning_rate: Additional properties are not allowed",
        "",
    ),
    (
        "workflow-micro-batch",
        "wide",
        lambda b: edit_workflow(b, lambda d: d["run"].update(micro_batch=256)),
        "workflow.yaml: key run/micro_batch: micro_batch 256 x micro_batches 32 = 8192, but global_batch is 16384",
        "compiled as 512",
    ),
    (
        "workflow-micro-batches",
        "wide",
        lambda b: edit_workflow(b, lambda d: d["run"].update(micro_batches=16)),
        "workflow.yaml: key run/micro_batches: micro_batch 512 x micro_batches 16 = 8192",
        "compiled as 32",
    ),
    (
        "workflow-global-batch",
        "wide",
        lambda b: edit_workflow(b, lambda d: d["run"].update(global_batch=8192)),
        "workflow.yaml: key run/global_batch: micro_batch 512 x micro_batches 32 = 16384, but global_batch is 8192",
        "compiled as 16384",
    ),
    (
        "workflow-function-replicas",
        "wide",
        lambda b: edit_workflow(b, lambda d: function(d, "wide-mlp-s0").update(replicas=4)),
        "workflow.yaml: key regions/0/functions/0/replicas: 4, but its steps (steps/0) have 8",
        "compiled as 8",
    ),
    (
        "workflow-function-and-steps-replicas",
        "wide",
        lambda b: edit_workflow(
            b, lambda d: (function(d, "wide-mlp-s0").update(replicas=4), set_step_replicas(d, "wide-mlp-s0", 4))
        ),
        "workflow.yaml: key regions/0/functions/0/replicas: 4, but plan.json has 8 at stages/0/replicas",
        "edited after the compile",
    ),
    (
        "workflow-step-replicas",
        "wide",
        lambda b: edit_workflow(b, lambda d: d["steps"][3].update(replicas=2)),
        "workflow.yaml: key steps/3/replicas: 2, but function 'wide-mlp-s1' has 8",
        "compiled as 8",
    ),
    (
        "workflow-inputs-renamed",
        "wide",
        lambda b: edit_workflow(b, lambda d: function(d, "wide-mlp-s1").update(inputs=["relu_9"])),
        "workflow.yaml: key regions/0/functions/1/inputs: stage 1 takes ['relu_9'], which stage 0 does not send",
        "compiled as ['relu_2']",
    ),
    (
        "workflow-outputs-renamed",
        "wide",
        lambda b: edit_workflow(b, lambda d: function(d, "wide-mlp-s0").update(outputs=["relu_9"])),
        "workflow.yaml: key regions/0/functions/0/outputs: stage 1 takes ['relu_2'], which stage 0 does not send",
        "compiled as ['relu_2']",
    ),
    (
        "workflow-last-outputs-renamed",
        "wide",
        lambda b: edit_workflow(b, lambda d: function(d, "wide-mlp-s1").update(outputs=["logits"])),
        "workflow.yaml: key regions/0/functions/1/outputs/0: 'logits', but the packages' function.json have 'linear_6'",
        "edited after the compile",
    ),
    (
        "workflow-data-inputs-renamed",
        "wide",
        lambda b: edit_workflow(b, lambda d: d["data"].update(inputs=["pixels"])),
        "workflow.yaml: key data/inputs: stage 0 takes ['input_1'], but data/inputs is ['pixels']",
        "compiled as ['input_1']",
    ),
    (
        "workflow-data-targets",
        "wide",
        lambda b: edit_workflow(b, lambda d: d["data"].update(targets=2)),
        "workflow.yaml: key data/targets: 2, but the packages' function.json have 1",
        "edited after the compile",
    ),
    (
        "workflow-blocks-gap",
        "wide",
        lambda b: edit_workflow(b, lambda d: function(d, "wide-mlp-s1").update(blocks=[5, 7])),
        "workflow.yaml: key regions/0/functions/1/blocks: stage 0 has blocks [0, 3] and stage 1 [5, 7]",
        "compiled as [4, 7]",
    ),
    (
        "workflow-blocks-short",
        "wide",
        lambda b: edit_workflow(b, lambda d: function(d, "wide-mlp-s1").update(blocks=[4, 6])),
        "workflow.yaml: key regions/0/functions/1/blocks: [4, 6]: the last stage must end at the chain's last block 7",
        "compiled as [4, 7]",
    ),
    (
        "workflow-stages-gapped",
        "wide",
        lambda b: edit_workflow(b, lambda d: function(d, "wide-mlp-s1").update(stage=2)),
        "workflow.yaml: key regions/0/functions: stages [0, 2]; expected 0..1",
        "",
    ),
    (
        "workflow-optimizer-class",
        "wide",
        lambda b: edit_workflow(b, lambda d: d["optimizer"].update({"class": "Adamm"})),
        "workflow.yaml: key optimizer/class: 'Adamm' is not a torch.optim optimizer",
        "compiled as 'SGD'",
    ),
    (
        "workflow-optimizer-options",
        "wide",
        lambda b: edit_workflow(b, lambda d: d["optimizer"]["options"].update(betas=[0.9, 0.99])),
        "workflow.yaml: key optimizer/options: torch.optim.SGD refuses them",
        "betas",
    ),
    # plan.json
    (
        "plan-replicas",
        "wide",
        lambda b: edit_json(b / "plan.json", lambda d: d["stages"][0].update(replicas=4)),
        "plan.json: key stages/0/replicas: 4, but workflow.yaml has 8 at regions/0/functions/0/replicas",
        "edited after the compile",
    ),
    (
        "plan-tier",
        "wide",
        lambda b: edit_json(b / "plan.json", lambda d: d["stages"][1].update(tier_mb=3008)),
        "plan.json: key stages/1/tier_mb: 3008, but workflow.yaml has 10240 at regions/0/functions/1/memory_mb",
        "edited after the compile",
    ),
    (
        "plan-micro-batch",
        "wide",
        lambda b: edit_json(b / "plan.json", lambda d: d.update(micro_batch=256)),
        "plan.json: key micro_batch: 256, but workflow.yaml has 512 at run/micro_batch",
        "",
    ),
    # the manifest
    (
        "manifest-deleted",
        "wide",
        lambda b: (b / BUILD_MARKER).unlink(),
        "cloudless-build.json: key (file): missing: not a build written by cloudless-compile",
        "recompile",
    ),
    (
        "manifest-not-json",
        "wide",
        lambda b: replace(b / BUILD_MARKER, "{", "["),
        "cloudless-build.json: key (top level): not JSON",
        "recompile",
    ),
    (
        "manifest-entry-edited",
        "wide",
        lambda b: edit_json(b / BUILD_MARKER, lambda d: d["files"].update({f"{S0}/stage.py": "sha256:" + "0" * 64})),
        f"{S0}/stage.py: key (digest): differs from cloudless-build.json",
        "recompile",
    ),
    (
        "manifest-entry-malformed",
        "wide",
        lambda b: edit_json(b / BUILD_MARKER, lambda d: d["files"].update({"plan.json": "md5:1234"})),
        "cloudless-build.json: key files/plan.json: 'md5:1234' is not sha256:<64 hex digits>",
        "",
    ),
    (
        "manifest-entry-removed",
        "wide",
        lambda b: edit_json(b / BUILD_MARKER, lambda d: d["files"].pop(f"{S1}/handler.py")),
        f"{S1}/handler.py: key (file): not in cloudless-build.json",
        "deployed whole",
    ),
    # two regions
    (
        "geo-weight",
        "geo",
        lambda b: edit_workflow(b, edit_geo_weight),
        "workflow.yaml: key regions/0/weight: the regions' weights add up to 1.25, not 1",
        "compiled as 0.52",
    ),
    (
        "geo-rounds-beyond-iterations",
        "geo",
        lambda b: edit_workflow(b, lambda d: d["regions"][1].update(iterations=10)),
        "workflow.yaml: key regions/1/iterations: region 'aws-eu-west-1': 20 rounds over 10 iterations",
        "compiled as 95",
    ),
    (
        "geo-sync-iterations",
        "geo",
        lambda b: edit_workflow(b, lambda d: d["sync"].update(inter_region="sync")),
        "workflow.yaml: key regions/0/iterations: region 'aws-us-east-1': iterations 105, but run/iterations 200",
        "under sync every region runs every iteration",
    ),
    (
        "geo-shared-bucket",
        "geo",
        lambda b: replace(
            b / f"regions/{WEST}/stack.yaml",
            "s3://cloudless-mlp-digits-geo-aws-eu-west-1/",
            "s3://cloudless-mlp-digits-geo-aws-us-east-1/",
        ),
        f"regions/{WEST}/stack.yaml: key functions/*/environment/CLOUDLESS_STORAGE: "
        "'s3://cloudless-mlp-digits-geo-aws-us-east-1/mlp-digits-geo' is region 'aws-us-east-1''s storage too",
        "its own bucket",
    ),
    (
        "geo-peer-parameter-missing",
        "geo",
        lambda b: replace(b / f"regions/{WEST}/template.yaml", "  PeerBucketAwsUsEast1:\n", "  OtherBucket:\n"),
        f"regions/{WEST}/template.yaml: key Resources/MlpDigitsGeoS0Function/Properties/Environment/Variables/"
        "CLOUDLESS_PEERS/Fn::Sub: 'PeerBucketAwsUsEast1'",
        "neither a resource nor a parameter",
    ),
    (
        "geo-no-inter-region-sync",
        "geo",
        lambda b: edit_workflow(b, lambda d: d["sync"].update(inter_region=None)),
        "workflow.yaml: key sync/inter_region: null, but 2 regions train",
        "",
    ),
    (
        "geo-data-source-count",
        "geo",
        lambda b: edit_workflow(b, lambda d: d["regions"][1]["data_sources"][1].update(count=200)),
        "workflow.yaml: key regions/1/data_sources/1/count: 200, but the region's samples are 683",
        "compiled as 252",
    ),
    (
        "geo-function-json-region",
        "geo",
        lambda b: edit_function_json(b, GEO_WEST, lambda d: d.update(region=EAST)),
        f"{GEO_WEST}/function.json: key region: 'aws-us-east-1'; expected 'aws-eu-west-1', whose package this is",
        "edited after the compile",
    ),
    (
        "geo-plan-site-replicas",
        "geo",
        lambda b: edit_json(b / "plan.json", lambda d: d["regions"]["sites"][1]["stages"][0].update(replicas=2)),
        "plan.json: key regions/sites/1/stages/0/replicas: 2, but workflow.yaml has 1",
        "at regions/1/functions/0/replicas",
    ),
]


@pytest.mark.parametrize(("build_name", "edit", "start", "phrase"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_hand_edit_fails_the_check(
    compiled: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    build_name: str,
    edit: Callable[[Path], None],
    start: str,
    phrase: str,
) -> None:
    build = copy(compiled, build_name, tmp_path)
    edit(build)
    message = check_fails(build, capsys)
    assert message.startswith(start), message
    assert phrase in message, message


def test_corpus_is_distinct() -> None:
    assert len({c[0] for c in CORPUS}) == len(CORPUS) >= 24


@pytest.mark.parametrize("name", list(BUILDS))
def test_untouched_build_passes(compiled: dict[str, Path], name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check", str(compiled[name])]) == 0
    assert "every check passed" in capsys.readouterr().out


def test_python_caches_of_a_local_run_are_not_extra_files(compiled: dict[str, Path], tmp_path: Path) -> None:
    """A local run imports the vendored runtime, and Python writes its caches into the package."""
    build = copy(compiled, "wide", tmp_path)
    cache = build / S0 / "cloudless" / "runtimes" / "__pycache__"
    cache.mkdir()
    (cache / "worker.cpython-311.pyc").write_bytes(b"\0" * 16)
    (build / "run").mkdir()
    (build / "run" / "metrics.json").write_text("{}")
    check_build(build)


def test_an_edit_with_refreshed_digests_is_still_caught(compiled: dict[str, Path], tmp_path: Path) -> None:
    """The semantic checks do not lean on the digests: halve micro_batch everywhere the workflow is
    written, rewrite the manifest to match, and the batch sizes still disagree."""
    build = copy(compiled, "wide", tmp_path)
    edit_workflow(build, lambda d: d["run"].update(micro_batch=256))
    for package in (S0, S1):
        edit_function_json(build, package, lambda d: d["workflow"]["run"].update(micro_batch=256))
    edit_json(build / "plan.json", lambda d: d.update(micro_batch=256))
    refresh_manifest(build)
    with pytest.raises(BuildCheckError, match=r"^workflow\.yaml: key run/micro_batch: micro_batch 256 x"):
        check_build(build)


def test_stage_tensors_and_weights_edited_together_need_the_digests(compiled: dict[str, Path], tmp_path: Path) -> None:
    """A consistent edit of a stage's TENSORS and its weights runs, but not as compiled: only the digests
    see it, and with refreshed digests nothing can."""
    build = copy(compiled, "wide", tmp_path)
    replace(build / S1 / "stage.py", "'6.bias': ((1024,)", "'6.bias': ((512,)")
    weights_with(build, S1, lambda t: t.update({"6.bias": t["6.bias"][:512].clone()}))
    with pytest.raises(BuildCheckError, match=rf"^{S1}/stage\.py: key \(digest\)"):
        check_build(build)


def test_weights_header_is_parsed_not_loaded(compiled: dict[str, Path], tmp_path: Path) -> None:
    """A header claiming more data than the file holds is caught without reading the tensors."""
    build = copy(compiled, "wide", tmp_path)
    path = build / S0 / "weights.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [*header[name]["shape"], 2]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    with pytest.raises(BuildCheckError, match=rf"^{S0}/weights\.safetensors: key {name}: data_offsets"):
        check_build(build)


def test_tied_parameters_across_stages(tmp_path: Path) -> None:
    """tricky.py's tied embedding split over three hand-chosen stages: the packages pass; a stage that
    holds the tied weight but does not list it (workflow.yaml and every function.json edited alike,
    digests refreshed) would train its copy apart, and is caught. (No deployment files: the packages are
    checked before them.)"""
    from cloudless.ir.files import build_manifest

    from .runtime_cases import front_end, write_packages

    build = tmp_path / "tricky"
    result = front_end(MODELS / "tricky.py", batch_size=4)
    last = len(result.chain.blocks) - 1
    write_packages(result, build, [(0, 3, 1), (4, 8, 2), (9, last, 1)], micro_batch=4, global_batch=16, iterations=4)
    files = {p.relative_to(build).as_posix(): p.read_bytes() for p in build.rglob("*") if p.is_file()}
    (build / BUILD_MARKER).write_bytes(build_manifest(files))
    with pytest.raises(BuildCheckError, match=f"^regions/{EAST}: key \\(folder\\): neither stack.yaml"):
        check_build(build)
    tied = "embed.weight"
    assert tied in function(yaml.safe_load((build / "workflow.yaml").read_text()), "tricky-s2")["shared_parameters"]

    def forget(document: dict[str, Any]) -> None:
        function(document, "tricky-s2")["shared_parameters"] = []

    edit_workflow(build, forget)
    for path in build.rglob("function.json"):
        edit_json(path, lambda d: forget(d["workflow"]))
    refresh_manifest(build)
    with pytest.raises(BuildCheckError) as caught:
        check_build(build)
    assert str(caught.value).startswith(
        "workflow.yaml: key regions/0/functions/2/shared_parameters: stage 2 holds the tied parameter 'embed.weight'"
    ), caught.value


def test_a_missing_build_folder_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(BuildCheckError, match=r"nowhere: no such folder; expected a build folder"):
        check_build(tmp_path / "nowhere")
