"""What load_shard may give besides a map-style dataset: an IterableDataset (or any iterable) and a Hugging
Face `datasets.Dataset` of dict rows (DATA_COLUMNS). Each is staged as the same samples in a map-style
dataset are: the same fingerprint (a second kind of source reuses the first's staging), the same model."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cloudless.compiler.cli import main as compile_main
from cloudless.runtimes.cli import main as run_main
from tests.data_cases import DIGITS_MLP

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
        assert compile_main([str(model), "-o", str(build), "--stages", "2", "--repeats", "1", "-q"]) == 0
    return model, build


@pytest.mark.slow  # three runs
def test_an_iterable_and_a_hugging_face_dataset_stage_the_map_style_datasets_samples(
    digits_build: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    model, build = digits_build
    storage = ["--storage", str(tmp_path / "storage")]
    models = {}
    for kind in ("map", "iterable", "hf"):
        monkeypatch.setenv("DIGITS_SOURCE", kind)
        capsys.readouterr()
        assert run_main([str(build), "--out", str(tmp_path / kind), "--model", str(model), *storage]) == 0
        banner = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data: "))
        action = re.search(r"train 300 samples \(sha256:[0-9a-f]+, (\w+)", banner)
        assert action is not None, banner
        assert action.group(1) == ("staged" if kind == "map" else "reused"), (kind, banner)  # the same content
        assert "test 64 samples" in banner, banner
        models[kind] = load_file(tmp_path / kind / "model.safetensors")
    for kind in ("iterable", "hf"):
        assert models[kind].keys() == models["map"].keys()
        assert all((models[kind][name] == models["map"][name]).all() for name in models["map"]), kind


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
    assert "load_shard('aws-us-east-1', 'train')[0] is a row of columns 'pixels', 'label'" in line, line
    assert 'DATA_COLUMNS = {"inputs": ["input_ids", ...], "target": "labels"}' in line, line
