"""What load_shard may give besides a map-style dataset: an IterableDataset (or any iterable) and a Hugging
Face `datasets.Dataset` of dict rows (DATA_COLUMNS). A `datasets.Dataset` is staged as the same samples in a
map-style dataset are: the same fingerprint (it reuses the other's staging), the same model. A stream is
staged in the order it comes (a map-style dataset's in `staging_order`), and trains as a plain loop over it."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cloudless.compiler.cli import main as compile_main
from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.ir.sample_order import staging_order
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as run_main
from tests.data_cases import DIGITS_MLP
from tests.reference import plain_training

MODEL = (
    DIGITS_MLP
    + """
import os

import torch
from sklearn.datasets import load_digits
from torch import nn

TRAINING = {"global_batch_size": 32, "micro_batch_sizes": [8], "iterations": 4, "learning_rate": 0.1}
DATA_COLUMNS = {"inputs": ["pixels"], "target": "label"}


def _digits(split):
    digits = load_digits()
    rows = range(0, 300) if split == "train" else range(300, 364)
    return [(torch.tensor(digits.data[i], dtype=torch.float32) / 16, int(digits.target[i])) for i in rows]


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, split):
        self.split = split

    def __iter__(self):
        for pixels, label in _digits(self.split):
            yield (pixels,), torch.tensor(label)



def load_shard(region, split):
    kind = os.environ["DIGITS_SOURCE"]
    if kind == "map":
        return [((pixels,), torch.tensor(label)) for pixels, label in _digits(split)]
    if kind == "iterable":
        return Stream(split)
    import datasets

    rows = _digits(split)
    return datasets.Dataset.from_dict({"pixels": [p.tolist() for p, _ in rows], "label": [l for _, l in rows]})
"""
)


@pytest.fixture(scope="module")
def digits_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("sources")
    model = folder / "digits_sources.py"
    model.write_text(textwrap.dedent(MODEL))
    build = folder / "build"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DIGITS_SOURCE", "map")
        options = ["--stages", "2", "--replicas", "2", "--repeats", "1", "-q"]
        assert compile_main([str(model), "-o", str(build), *options]) == 0
    return model, build


@pytest.mark.slow  # three runs
def test_an_iterable_and_a_hugging_face_dataset_train_as_plain_loops_over_them(
    digits_build: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    model, build = digits_build
    storage = ["--storage", str(tmp_path / "storage")]
    workflow = Workflow.from_json(yaml.safe_load((build / "workflow.yaml").read_text()))
    assert [f.replicas for f in workflow.regions[0].functions] == [2, 2]
    models = {}
    for kind, staged in (("map", "staged"), ("hf", "reused"), ("iterable", "restaged")):
        monkeypatch.setenv("DIGITS_SOURCE", kind)
        capsys.readouterr()
        assert run_main([str(build), "--out", str(tmp_path / kind), "--model", str(model), *storage]) == 0
        banner = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data: "))
        action = re.search(r"train 300 samples \(sha256:[0-9a-f]+, (\w+)", banner)
        assert action is not None, banner
        assert action.group(1) == staged, (kind, banner)  # a datasets.Dataset is the map-style dataset's content
        assert "test 64 samples" in banner, banner
        models[kind] = load_file(tmp_path / kind / "model.safetensors")
    assert models["hf"].keys() == models["map"].keys()
    assert all((models["hf"][name] == models["map"][name]).all() for name in models["map"])
    for kind in ("map", "iterable"):
        monkeypatch.setenv("DIGITS_SOURCE", kind)
        expected = plain_training(load_model_file(model), workflow, workflow.regions[0].name)
        for name, value in expected.items():
            torch.testing.assert_close(models[kind][name], value, rtol=1e-5, atol=1e-6, msg=f"{kind}: {name}")
    assert any((models["iterable"][name] != models["map"][name]).any() for name in models["map"])  # its own order


@pytest.mark.slow  # the module's compile
def test_dict_rows_without_data_columns_are_one_line(
    digits_build: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    model, build = digits_build
    changed = tmp_path / "digits_sources.py"
    changed.write_text(model.read_text().replace('DATA_COLUMNS = {"inputs": ["pixels"], "target": "label"}', ""))
    monkeypatch.setenv("DIGITS_SOURCE", "hf")
    capsys.readouterr()
    assert (
        run_main([str(build), "--out", str(tmp_path / "out"), "--model", str(changed), "-q", "--no-verify-build"]) == 2
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    first = int(staging_order(300)[0])  # the first row staged
    assert f"load_shard('aws-us-east-1', 'train')[{first}] is a row of columns 'pixels', 'label'" in line, line
    assert 'DATA_COLUMNS = {"inputs": ["input_ids", ...], "target": "labels"}' in line, line
