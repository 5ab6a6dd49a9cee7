"""Training data where it lies: WebDataset shards in a folder or in S3, named by load_shard, read by the
first stage through the model file's transform and collate, never through the controller; a run in
2 stages x 2 replicas trains what a plain PyTorch loop reading the same shards in the same order trains."""

from __future__ import annotations

import io
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import webdataset
import yaml
from safetensors.torch import load_file
from sklearn.datasets import load_digits
from torch.utils.data import default_collate

from cloudless.compiler.cli import main as compile_main
from cloudless.ir.protocol import S3_ENDPOINT_ENV
from cloudless.ir.sample_order import SHUFFLE_SHARDS, ShardOrder, sample_seed
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.function.data import read_meta
from cloudless.runtimes.storage.channels import DirectoryChannel
from tests.data_cases import DIGITS_MLP
from tests.iam import act_as_a_user_holding

MODEL = (
    DIGITS_MLP
    + """
import io

import numpy as np
import torch
from torch import nn

TRAINING = {"global_batch_size": 32, "micro_batch_sizes": [8], "iterations": ITERATIONS, "learning_rate": 0.2}



def load_shard(region, split):
    return LOCATION


def transform(sample, *, epoch, index):
    pixels = torch.from_numpy(np.load(io.BytesIO(sample["npy"]))).float() / 16
    jitter = 0.05 * torch.randn(64)  # an augmentation: drawn from the generator seeded per sample
    return (pixels + jitter,), torch.tensor(int(sample["cls"]))
"""
)
ITERATIONS = 6
COUNTS = {"train": (97, 60, 130, 41, 88), "test": (64,)}


def write_digit_shards(folder: Path, first: int = 0) -> dict[str, list[str]]:
    """Real data (scikit-learn's digits from `first` on) as WebDataset shards, `.npy` pixels and a `.cls` label."""
    digits = load_digits()
    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[str]] = {}
    position = first
    for split, counts in COUNTS.items():
        with webdataset.ShardWriter(str(folder / f"{split}-%06d.tar"), maxcount=10**6, verbose=0) as sink:
            for shard, count in enumerate(counts):
                if shard:
                    sink.next_stream()
                for _ in range(count):
                    buffer = io.BytesIO()
                    np.save(buffer, digits.data[position].astype(np.uint8))
                    sink.write(
                        {"__key__": f"d{position:05d}", "npy": buffer.getvalue(), "cls": int(digits.target[position])}
                    )
                    position += 1
        written[split] = [str(folder / f"{split}-{n:06d}.tar") for n in range(len(counts))]
    return written


def model_file(folder: Path, location: str) -> Path:
    path = folder / "digits_shards.py"
    source = MODEL.replace("ITERATIONS", str(ITERATIONS)).replace("LOCATION", location)
    path.write_text(textwrap.dedent(source))
    return path


def plain_loop(model: Path, shards: list[str], build: Path) -> dict[str, torch.Tensor]:
    """The same training as one PyTorch loop: webdataset reads the shards, ShardOrder picks each
    position's sample, the transform runs seeded by sample_seed, default_collate batches them."""
    user = _module(model)
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    seed = int(workflow["run"]["seed"])
    rows = [list(webdataset.WebDataset(shard, shardshuffle=False, empty_check=False)) for shard in shards]
    order = ShardOrder(tuple(len(r) for r in rows), seed, SHUFFLE_SHARDS)
    net = user.build_model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.2)
    global_batch, micro = 32, 8
    for iteration in range(ITERATIONS):
        for m in range(global_batch // micro):
            items = []
            for located in order.span(iteration * global_batch + m * micro, micro):
                torch.manual_seed(sample_seed(seed, located.epoch, located.index))
                items.append(
                    user.transform(dict(rows[located.shard][located.row]), epoch=located.epoch, index=located.index)
                )
            (inputs,), target = default_collate(items)
            loss = torch.nn.functional.cross_entropy(net(inputs), target) / (global_batch // micro)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in net.state_dict().items()}


def compile_and_run(model: Path, tmp_path: Path, *run_options: str) -> tuple[Path, dict[str, Any]]:
    build, out = tmp_path / "build", tmp_path / "out"
    options = ["--stages", "2", "--replicas", "2", "--repeats", "1", "-q"]
    assert compile_main([str(model), "-o", str(build), *options]) == 0
    assert run_main([str(build), "--out", str(out), "--model", str(model), "-q", *run_options]) == 0
    return build, json.loads((out / "metrics.json").read_text())


def test_shards_in_a_folder_train_as_a_plain_loop_over_them(tmp_path: Path) -> None:
    shards = write_digit_shards(tmp_path / "data")
    model = model_file(tmp_path, '"data/" + split + "-{000000..%06d}.tar" % (4 if split == "train" else 0)')
    storage = ["--storage", str(tmp_path / "storage")]
    build, metrics = compile_and_run(model, tmp_path, *storage)
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    assert [f["replicas"] for f in workflow["regions"][0]["functions"]] == [2, 2]
    trained = load_file(tmp_path / "out" / "model.safetensors")
    expected = plain_loop(model, shards["train"], build)
    assert set(trained) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert metrics["status"] == "done"
    assert metrics["test"]["samples"] == 64 and 0 <= metrics["test"]["accuracy"] <= 1
    # the packages hold the model file, whose transform the first stage ran
    packages = sorted((build / "regions").glob("*/functions/*/user/digits_shards.py"))
    assert len(packages) == 2 and packages[0].read_bytes() == model.read_bytes()
    # and install what it imports (numpy, at the version here), what the vendored runtime does not
    for package in packages:
        installed = (package.parent.parent / "requirements.txt").read_text()
        assert f"numpy=={np.__version__}\n" in installed and "scikit-learn" not in installed
    # other data in the same shards' places, the next run on the same storage: its functions (warm, in this
    # process) read the new index and train on the new data
    shards = write_digit_shards(tmp_path / "data", first=500)
    again = tmp_path / "again"
    assert run_main([str(build), "--out", str(again), "--model", str(model), "-q", *storage]) == 0
    retrained, expected = load_file(again / "model.safetensors"), plain_loop(model, shards["train"], build)
    for name, value in expected.items():
        torch.testing.assert_close(retrained[name], value, rtol=1e-5, atol=1e-5, msg=name)
    # the member tables are the new shards' alone: those of the shards written over are deleted
    tables = list((tmp_path / "storage" / "data" / "aws-us-east-1" / "train" / "members").iterdir())
    assert len(tables) == len(COUNTS["train"]), tables


@pytest.mark.slow  # a header scan of 416 samples' files over HTTP, two runs
def test_shards_in_s3_are_read_by_the_functions_and_the_controller_reads_their_headers_only(
    tmp_path: Path, s3_bucket: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import boto3

    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)
    shards = write_digit_shards(tmp_path / "data")
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    for location in shards["train"]:
        s3.upload_file(location, s3_bucket, f"digits/{Path(location).name}")
    model = model_file(
        tmp_path, f'"s3://{s3_bucket}/digits/train-{{000000..000004}}.tar" if split == "train" else None'
    )
    build, out = tmp_path / "build", tmp_path / "out"
    assert compile_main([str(model), "-o", str(build), "--stages", "2", "--replicas", "2", "--repeats", "1", "-q"]) == 0
    capsys.readouterr()
    storage = ["--storage", str(tmp_path / "storage")]
    assert run_main([str(build), "--out", str(out), "--model", str(model), *storage]) == 0
    banner = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data: "))
    read = re.search(r"indexed: 5 shard\(s\), (\d+) request\(s\), ([\d,]+) bytes read", banner)
    assert read is not None, banner
    # headers only: per file a PAX header, its data and the file's header, and a byte of the file before
    # (tarfile's check that it is whole); the end's two blocks. A sample is two files.
    headers = (3 * 512 + 1) * 2 * sum(COUNTS["train"]) + 2 * 512 * len(COUNTS["train"])
    assert int(read.group(2).replace(",", "")) <= headers, banner
    trained = load_file(out / "model.safetensors")
    expected = plain_loop(model, shards["train"], build)
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=name)
    # a second run on the same shards reuses their index: a HEAD per shard
    again_out = tmp_path / "again"
    assert run_main([str(build), "--out", str(again_out), "--model", str(model), "--iterations", "1", *storage]) == 0
    again = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data: "))
    assert "reused: 5 shard(s), 5 request(s), 0 bytes read" in again, again


@pytest.mark.slow  # compiles and runs
def test_an_epoch_of_shards_in_place_is_counted_at_compile_time_from_their_headers(tmp_path: Path, capsys) -> None:
    write_digit_shards(tmp_path / "data")
    model = model_file(tmp_path, '"data/" + split + "-{000000..%06d}.tar" % (4 if split == "train" else 0)')
    model.write_text(model.read_text().replace(f'"iterations": {ITERATIONS}', '"epochs": 2'))
    build = tmp_path / "build"
    assert compile_main([str(model), "-o", str(build), "--stages", "2", "--repeats", "1", "-q"]) == 0
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    # two passes over the 416 samples of the five shards at the global batch of 32
    assert workflow["run"]["iterations"] == -(-2 * sum(COUNTS["train"]) // 32) == 26
    assert workflow["regions"][0]["samples"] == sum(COUNTS["train"])
    # run on other data than the compile counted: it says so (the run's length came from the count); the
    # model file is written again, the build's record of it is not
    fewer = model_file(tmp_path, '"data/" + split + "-{000000..%06d}.tar" % (3 if split == "train" else 0)')
    capsys.readouterr()
    options = ["--out", str(tmp_path / "out"), "--model", str(fewer), "--iterations", "1", "-q", "--no-verify-build"]
    assert run_main([str(build), *options]) == 0
    expected = (
        f"warning: aws-us-east-1's train split holds 328 samples, where the compile counted {sum(COUNTS['train'])}"
    )
    assert expected in capsys.readouterr().err
    # a shard that is not there: one line at compile time, naming the model file and the shard; no build
    model = model_file(tmp_path, '"data/" + split + "-{000000..%06d}-gone.tar" % (4 if split == "train" else 0)')
    capsys.readouterr()
    assert compile_main([str(model), "-o", str(tmp_path / "other"), "--stages", "2", "--repeats", "1", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(
        r"digits_shards\.py: load_shard\('\S+', 'train'\): .*000000-gone\.tar", err[0]
    ), err
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize(
    ("location", "extra", "expected"),
    [
        ('"data/missing-{0..1}.tar"', "", r"the train split: .*/data/missing-0\.tar: no such file"),
        pytest.param(
            '"data/train-000000.tar"',
            "del transform\n",
            r"define transform\(sample, \*, epoch, index\)",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            '"s3://no-such-bucket-here/t.tar"',
            "",
            r"s3://no-such-bucket-here/t\.tar: no such (bucket|object)",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_shards_that_cannot_be_read_are_one_line_before_any_function_starts(
    location: str, extra: str, expected: str, tmp_path: Path, moto_endpoint: str, aws_env: None, monkeypatch, capsys
) -> None:
    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)
    write_digit_shards(tmp_path / "data")
    # compiled while the shards could be read (the compile reads their index too), run when they cannot
    model = model_file(tmp_path, '"data/train-{000000..000004}.tar"')
    build, out = tmp_path / "build", tmp_path / "out"
    assert compile_main([str(model), "-o", str(build), "--stages", "2", "--repeats", "1", "-q"]) == 0
    model = model_file(tmp_path, location)
    model.write_text(model.read_text() + extra)
    capsys.readouterr()
    assert run_main([str(build), "--out", str(out), "--model", str(model), "-q", "--no-verify-build"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(expected, err[0]), err
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (
            'def transform(sample, *, epoch, index):\n    raise ValueError("bad pixels")\n',
            r"the transform of sample \d+ of .*/data/train-00000\d\.tar of stage 0 .* raised ValueError: bad pixels "
            r"\(at digits_shards\.py:\d+\)",
        ),
        pytest.param(
            "def collate_fn(samples):\n"
            "    return (torch.zeros(8, 64), torch.zeros(8, 64)), torch.zeros(8, dtype=torch.int64)\n",
            r"micro-batch \d's collated inputs have 2 tensors, but the model takes 1",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "def collate_fn(samples):\n"
            "    return (torch.zeros(8, 64, dtype=torch.float64),), torch.zeros(8, dtype=torch.int64)\n",
            r"micro-batch \d's collate_fn on stage 0: inputs 0 is float64 \[8, 64\], but example_inputs's is "
            r"float32 of 2 dimensions \(\[8, 64\]\)",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "def collate_fn(samples):\n    return (torch.zeros(8, 64),), torch.zeros(5, dtype=torch.int64)\n",
            r"targets 0 is int64 \[5\]: 5 samples, where the micro-batch is 8",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_user_code_that_fails_in_the_function_names_the_sample_and_the_line(
    code: str, expected: str, tmp_path: Path, capsys
) -> None:
    write_digit_shards(tmp_path / "data")
    model = model_file(tmp_path, '"data/" + split + "-{000000..%06d}.tar" % (4 if split == "train" else 0)')
    model.write_text(model.read_text() + "\n\n" + code)
    build, out = tmp_path / "build", tmp_path / "out"
    assert compile_main([str(model), "-o", str(build), "--stages", "2", "--repeats", "1", "-q"]) == 0
    capsys.readouterr()
    assert run_main([str(build), "--out", str(out), "--model", str(model), "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(expected, err[0]), err


@pytest.mark.slow
@pytest.mark.parametrize("invoker", ["lambda", "openfaas"])
def test_each_rehearsal_reads_shards_in_its_functions_as_the_plain_loop_does(invoker: str, tmp_path: Path) -> None:
    """The functions are processes of their packages here: the model file and its transform come from the
    package's user/ folder, the shards from where they lie."""
    shards = write_digit_shards(tmp_path / "data")
    model = model_file(tmp_path, '"data/" + split + "-{000000..%06d}.tar" % (4 if split == "train" else 0)')
    build, metrics = compile_and_run(model, tmp_path, "--invoker", invoker, "--rehearse")
    assert metrics["status"] == "done" and metrics["invoker"] == invoker
    trained = load_file(tmp_path / "out" / "model.safetensors")
    for name, value in plain_loop(model, shards["train"], build).items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_a_deployed_run_refuses_shards_in_a_folder_of_this_machine(tmp_path: Path) -> None:
    from cloudless.runtimes.control.staging import DataError, stage_data
    from cloudless.runtimes.storage.channels import DirectoryChannel

    write_digit_shards(tmp_path / "data")
    model = model_file(tmp_path, '"data/" + split + "-{000000..%06d}.tar" % (4 if split == "train" else 0)')
    channel = DirectoryChannel(tmp_path / "storage")
    with pytest.raises(DataError, match=r"shards in a folder of this machine \(/.*/data/train-\{000000\.\.000004\}"):
        stage_data(channel, "aws-us-east-1", model, deployed=True)
    assert stage_data(channel, "aws-us-east-1", model)["train"] == sum(COUNTS["train"])  # a local run reads them


def check_the_grant_in_moto_with_iam_enforced(
    statement: dict[str, Any], bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first stage's reads of a shard (GetObject at the indexed version) under that statement alone, in
    moto with IAM enforced: a shard of the pattern is read, an object beside it is refused in one line."""
    import boto3
    from moto import mock_aws
    from moto.core import set_initial_no_auth_action_count

    from cloudless.runtimes.storage.objects import ObjectError, S3Objects

    resources = [r["Fn::Sub"].replace("${AWS::Partition}", "aws") for r in statement["Resource"]]
    policy = {"Version": "2012-10-17", "Statement": [{**statement, "Resource": resources}]}
    for variable, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv(S3_ENDPOINT_ENV, raising=False)

    @mock_aws
    @set_initial_no_auth_action_count(5)  # the set-up's five requests; every later one is authorized
    def run() -> None:
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket=bucket)
        shard = s3.put_object(Bucket=bucket, Key="digits/train-000003.tar", Body=b"a shard")["ETag"]
        act_as_a_user_holding(policy, monkeypatch)  # the function's credentials from now on
        store = S3Objects(ride_out_s=1.0)
        assert store.read(f"s3://{bucket}/digits/train-000003.tar", shard) == b"a shard"
        with pytest.raises(ObjectError, match=rf"^s3://{bucket}/digits/test-000000\.tar: access denied \(403\)"):
            store.read(f"s3://{bucket}/digits/test-000000.tar", shard)

    try:
        run()
    finally:
        boto3.DEFAULT_SESSION = None  # later tests make their own


def test_a_deployed_first_stage_may_read_the_shards_the_build_was_compiled_for_and_no_others(
    tmp_path: Path, s3_bucket: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    from cloudless.runtimes.control.staging import DataError, stage_data
    from cloudless.runtimes.storage.channels import DirectoryChannel

    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    for location in write_digit_shards(tmp_path / "data")["train"]:  # the compile reads their sizes
        s3.upload_file(location, s3_bucket, f"digits/{Path(location).name}")
    model = model_file(tmp_path, f'"s3://{s3_bucket}/digits/" + split + "-{{000000..000004}}.tar"')
    build = tmp_path / "build"
    assert compile_main([str(model), "-o", str(build), "--stages", "2", "--repeats", "1", "-q"]) == 0
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    assert workflow["regions"][0]["data_in_place"] == [f"s3://{s3_bucket}/digits/train-{{000000..000004}}.tar"]
    template = yaml.safe_load((build / "regions" / "aws-us-east-1" / "template.yaml").read_text())
    grants = {}
    for function in (r for r in template["Resources"].values() if r["Type"] == "AWS::Serverless::Function"):
        statements = function["Properties"]["Policies"][0]["Statement"]
        grants[function["Properties"]["FunctionName"]] = [s for s in statements if s.get("Sid") == "DataInPlace"]
    first, second = (grants[name] for name in sorted(grants))
    # the first stage reads the shards (GetObject only, under the pattern's fixed part); the second reads none
    assert first == [
        {
            "Sid": "DataInPlace",
            "Effect": "Allow",
            "Action": "s3:GetObject",
            "Resource": [{"Fn::Sub": f"arn:${{AWS::Partition}}:s3:::{s3_bucket}/digits/train-*"}],
        }
    ]
    assert second == []
    check_the_grant_in_moto_with_iam_enforced(first[0], s3_bucket, monkeypatch)
    # load_shard naming other shards than the build grants: one line before any function starts
    model.write_text(model.read_text().replace(f"s3://{s3_bucket}/", "s3://other-data/"))
    with pytest.raises(DataError, match=r"names s3://other-data/digits/train-.*, but the build was compiled for "):
        stage_data(
            DirectoryChannel(tmp_path / "storage"),
            "aws-us-east-1",
            model,
            deployed=True,
            granted=tuple(workflow["regions"][0]["data_in_place"]),
        )


@pytest.mark.slow
def test_the_jpeg_sample_writes_its_shards_the_same_way_and_trains_on_them(tmp_path: Path) -> None:
    """samples/digits_jpeg.py as a user runs it: its shards (written by its first load_shard, byte for byte
    the same on every machine), compiled, trained with the JPEGs decoded and cropped in the function."""
    import importlib.util

    sample = Path(__file__).resolve().parent.parent / "samples" / "digits_jpeg.py"
    spec = importlib.util.spec_from_file_location("digits_jpeg_sample", sample)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for folder in ("a", "b"):
        module.write_shards(tmp_path / folder)
    written = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert written == [f"test-00000{n}.tar" for n in range(2)] + [f"train-00000{n}.tar" for n in range(6)]
    assert all((tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes() for name in written)
    build, out = tmp_path / "build", tmp_path / "out"
    assert compile_main([str(sample), "-o", str(build), "--repeats", "1", "-q"]) == 0
    assert run_main([str(build), "--out", str(out), "--model", str(sample), "-q"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and metrics["test"]["samples"] == 352
    assert metrics["test"]["accuracy"] > 0.7  # its 120 iterations: 0.83 measured (chance: 0.1)


PADDED_MODEL = """
import torch
from torch import nn

TRAINING = {"global_batch_size": 32, "micro_batch_sizes": [8], "iterations": ITERATIONS, "learning_rate": 0.2}
LONGEST = 64


class Bag(nn.Module):
    \"\"\"Mean of the embedded tokens under the mask: what a text classifier over padded batches does.\"\"\"

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(17, 16)
        self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, tokens, mask):
        embedded = self.embed(tokens) * mask.unsqueeze(-1)
        return self.head(embedded.sum(1) / mask.sum(1, keepdim=True))


def build_model():
    torch.manual_seed(0)
    return Bag()


def example_inputs(batch_size):
    return torch.zeros(batch_size, LONGEST, dtype=torch.int64), torch.ones(batch_size, LONGEST)


def example_targets(batch_size):
    return torch.zeros(batch_size, dtype=torch.int64)


def load_shard(region, split):
    return "data/" + split + ("-{0,1}.parquet" if split == "train" else "-0.parquet")


def transform(row, *, epoch, index):
    tokens = torch.tensor(row["pixels"])
    keep = int(torch.randint(len(tokens) // 2, len(tokens) + 1, ()))  # a random crop: seeded per sample
    return tokens[:keep], torch.tensor(row["label"])


def collate_fn(samples):
    \"\"\"Pad to the batch's longest: a micro-batch is as wide as its samples need.\"\"\"
    longest = max(len(tokens) for tokens, _ in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest)
    for row, (sample, _) in enumerate(samples):
        tokens[row, : len(sample)] = sample
        mask[row, : len(sample)] = 1
    return (tokens, mask), torch.stack([label for _, label in samples])
"""


def write_digit_parquet(folder: Path) -> dict[str, list[str]]:
    """The digits as rows of variable length (each image's pixels up to its last nonzero one), in Parquet
    files of row groups of 50, as pyarrow writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    digits = load_digits()
    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[str]] = {}
    position = 0
    for split, counts in {"train": (230, 190), "test": (64,)}.items():
        written[split] = []
        for part, count in enumerate(counts):
            rows = []
            for _ in range(count):
                pixels = digits.data[position].astype(int).tolist()
                last = max(i for i, value in enumerate(pixels) if value) + 1
                rows.append({"pixels": pixels[:last], "label": int(digits.target[position])})
                position += 1
            path = folder / f"{split}-{part}.parquet"
            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=50)
            written[split].append(str(path))
    return written


@pytest.mark.slow  # the default run trains shards in place once (a folder of tars)
def test_parquet_rows_of_any_length_padded_per_batch_train_as_a_plain_loop_over_them(tmp_path: Path) -> None:
    """Parquet row groups as shards, a transform cropping each row at random, a collate_fn padding each
    micro-batch to its longest: 2 stages x 2 replicas train what the plain loop over pyarrow's rows does."""
    import pyarrow.parquet as pq

    files = write_digit_parquet(tmp_path / "data")
    model = tmp_path / "digits_padded.py"
    model.write_text(textwrap.dedent(PADDED_MODEL.replace("ITERATIONS", str(ITERATIONS))))
    build, metrics = compile_and_run(model, tmp_path, "--storage", str(tmp_path / "storage"))
    assert metrics["status"] == "done" and metrics["test"]["samples"] == 64
    for package in sorted((build / "regions").glob("*/functions/*")):  # the packages install Parquet's reader
        assert re.search(r"^pyarrow==", (package / "requirements.txt").read_text(), re.M), package
    user = _module(model)
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    seed = int(workflow["run"]["seed"])
    groups = [
        file.read_row_group(g).to_pylist()
        for path in files["train"]
        for file in [pq.ParquetFile(path)]
        for g in range(file.num_row_groups)
    ]
    order = ShardOrder(tuple(len(rows) for rows in groups), seed, SHUFFLE_SHARDS)
    net = user.build_model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.2)
    widths = set()
    for iteration in range(ITERATIONS):
        for m in range(4):
            items = []
            for located in order.span(iteration * 32 + m * 8, 8):
                torch.manual_seed(sample_seed(seed, located.epoch, located.index))
                row = dict(groups[located.shard][located.row])
                items.append(user.transform(row, epoch=located.epoch, index=located.index))
            (tokens, mask), target = user.collate_fn(items)
            widths.add(tokens.shape[1])
            (torch.nn.functional.cross_entropy(net(tokens, mask), target) / 4).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(widths) > 3  # the micro-batches were of many widths
    trained = load_file(tmp_path / "out" / "model.safetensors")
    for name, value in net.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=name)


def _module(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"plain_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_text_sample_reads_its_parquet_rows_in_place_and_learns_prose_from_code(tmp_path: Path) -> None:
    """samples/text_parquet.py as a user runs it: its Parquet files (written by its first load_shard),
    compiled, trained with each micro-batch padded to its longest line in the function."""
    sample = Path(__file__).resolve().parent.parent / "samples" / "text_parquet.py"
    module = _module(sample)
    module.write_files(tmp_path / "files")
    rows = [row for m in module.MODULES["train"] for row in module.stdlib_lines(m)]
    assert len(rows) > 1000 and sum(row["label"] for row in rows) * 2 == len(rows)  # as many of each
    build, out = tmp_path / "build", tmp_path / "out"
    assert compile_main([str(sample), "-o", str(build), "--repeats", "1", "-q"]) == 0
    packages = sorted((build / "regions").glob("*/functions/*"))
    assert all(re.search(r"^pyarrow==", (p / "requirements.txt").read_text(), re.M) for p in packages)
    assert run_main([str(build), "--out", str(out), "--model", str(sample), "-q"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done" and metrics["test"]["samples"] > 1000
    assert metrics["test"]["accuracy"] > 0.75  # its 150 iterations: 0.86 measured (chance: 0.5)


@pytest.mark.slow
def test_the_data_bench_runs_and_the_controller_reads_headers_only(tmp_path: Path) -> None:
    """bench/data_bench.py at 0.1 and 0.2 GB (a bench no test runs rots): the controller reads a few
    hundred bytes per sample's file, never the samples, and both read paths report a ratio."""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parent.parent / "bench" / "data_bench.py"
    command = [sys.executable, str(bench), "--sizes", "0.1,0.2", "--repeats", "1", "--folder", str(tmp_path / "d")]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-2000:]
    indexed = re.findall(r"(\d+) shard\(s\), (\d+) request\(s\), ([\d,]+) bytes read", finished.stdout)
    assert [int(shards) for shards, _, _ in indexed] == [1, 2], finished.stdout
    assert all(int(read.replace(",", "")) < int(shards) * 2_000_000 for shards, _, read in indexed)  # of 100 MB each
    found = re.search(r"ratios: folder indexed (\d\.\d\d), folder wids-listed \d\.\d\d, S3 indexed (\d\.\d\d), "
                      r"S3 wids-listed \d\.\d\d", finished.stdout)  # fmt: skip
    assert found is not None, finished.stdout


#: several regions, each reading its own bucket: the train shards of write_digit_shards, split between them
REGION_SHARDS = {"aws-us-east-1": (0, 1, 2), "aws-eu-west-1": (3, 4)}


def plain_model_average(model: Path, shards: dict[str, list[str]], workflow: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Model averaging as plain PyTorch loops, one per region over its own shards in ShardOrder: each region
    trains its iterations of every round, then every region takes the weighted mean of the regions' models."""
    from cloudless.ir.workflow import round_ends

    user = _module(model)
    seed, global_batch, micro = int(workflow["run"]["seed"]), 32, 8
    regions = workflow["regions"]
    rounds = int(workflow["sync"]["rounds"])
    nets, optimizers, rows, orders, ends = [], [], [], [], []
    for region in regions:
        read = [list(webdataset.WebDataset(s, shardshuffle=False, empty_check=False)) for s in shards[region["name"]]]
        rows.append(read)
        orders.append(ShardOrder(tuple(len(r) for r in read), seed, SHUFFLE_SHARDS))
        nets.append(user.build_model())
        optimizers.append(torch.optim.SGD(nets[-1].parameters(), lr=0.2))
        ends.append((0, *round_ends(int(region["iterations"]), rounds)))
    for round_index in range(rounds):
        for r in range(len(regions)):
            for iteration in range(ends[r][round_index], ends[r][round_index + 1]):
                for m in range(global_batch // micro):
                    items = []
                    for located in orders[r].span(iteration * global_batch + m * micro, micro):
                        torch.manual_seed(sample_seed(seed, located.epoch, located.index))
                        sample = dict(rows[r][located.shard][located.row])
                        items.append(user.transform(sample, epoch=located.epoch, index=located.index))
                    (inputs,), target = default_collate(items)
                    loss = torch.nn.functional.cross_entropy(nets[r](inputs), target) / (global_batch // micro)
                    loss.backward()
                optimizers[r].step()
                optimizers[r].zero_grad()
        mean = {
            name: sum(region["weight"] * net.state_dict()[name] for region, net in zip(regions, nets, strict=True))
            for name in nets[0].state_dict()
        }
        with torch.no_grad():
            for net in nets:
                for name, value in net.state_dict().items():
                    value.copy_(mean[name])
    return {k: v.detach() for k, v in nets[0].state_dict().items()}


@pytest.mark.slow  # header scans over HTTP, two regions' pipelines
def test_regions_each_train_on_their_own_buckets_shards_and_no_sample_passes_the_controller(
    tmp_path: Path, moto_endpoint: str, aws_env: None, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    import boto3

    monkeypatch.setenv(S3_ENDPOINT_ENV, moto_endpoint)
    written = write_digit_shards(tmp_path / "data")["train"]
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    buckets = {region: f"digits-{region}-{tmp_path.name[-8:]}".lower().replace("_", "-") for region in REGION_SHARDS}
    locations: dict[str, str] = {}
    shards: dict[str, list[str]] = {}
    for region, numbers in REGION_SHARDS.items():
        s3.create_bucket(Bucket=buckets[region])
        for n in numbers:
            s3.upload_file(written[n], buckets[region], f"digits/train-{n:06d}.tar")
        locations[region] = f"s3://{buckets[region]}/digits/train-{{{numbers[0]:06d}..{numbers[-1]:06d}}}.tar"
        shards[region] = [written[n] for n in numbers]
    model = model_file(tmp_path, f"{locations!r}[region] if split == 'train' else None")
    build, out, storage = tmp_path / "build", tmp_path / "out", tmp_path / "storage"
    regions = ",".join(REGION_SHARDS)
    options = ["--regions", regions, "--sync", "model-average", "--repeats", "1", "-q"]
    # data that stays where it lies must be trained there at least once a round: 6 iterations, 3 rounds
    capsys.readouterr()
    assert compile_main([str(model), "-o", str(build), *options, "--sync-every", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"aws-eu-west-1's data stays in it .* its share of the training is 1\.86 iterations, fewer than "
                     r"the 3 rounds", err), err  # fmt: skip
    model.write_text(model.read_text().replace(f'"iterations": {ITERATIONS}', '"iterations": 12'))
    assert compile_main([str(model), "-o", str(build), *options, "--sync-every", "4"]) == 0
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    # the plan counted each region's shards from their headers, and moved none: each trains what it holds
    held = {r["name"]: r["samples"] for r in workflow["regions"]}
    assert held == {region: sum(COUNTS["train"][n] for n in numbers) for region, numbers in REGION_SHARDS.items()}
    assert workflow["sync"]["rounds"] >= 2 and all(r["iterations"] >= 2 for r in workflow["regions"])
    assert {r["name"]: [s["region"] for s in r["data_sources"]] for r in workflow["regions"]} == {
        region: [region] for region in REGION_SHARDS
    }
    capsys.readouterr()
    assert run_main([str(build), "--out", str(out), "--model", str(model), "--storage", str(storage)]) == 0
    banners = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: ")]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "done"
    # each region's index in its own storage names its own bucket's shards, and the controller read their
    # headers only; the run's storage holds no sample of them (the functions read them where they lie)
    for region, numbers in REGION_SHARDS.items():
        data = storage / region / "data"
        held_files = sorted(p.relative_to(data) for p in data.rglob("*") if p.is_file())
        # the index and, per shard, its member table (names, offsets and sizes: a few bytes per file)
        assert [f.parts[1:] for f in held_files][-1] == ("train", "meta"), held_files
        tables = [data / f for f in held_files if f.parts[1:3] == ("train", "members")]
        assert len(tables) == len(numbers) == len(held_files) - 1, held_files
        assert sum(t.stat().st_size for t in tables) < 100 * sum(COUNTS["train"][n] for n in numbers)
        meta = read_meta(DirectoryChannel(storage / region), held_files[0].parts[0], "train")
        assert meta is not None
        assert [e["location"] for e in meta["shards"]] == [
            f"s3://{buckets[region]}/digits/train-{n:06d}.tar" for n in numbers
        ]
    read = [re.findall(r"(\d+) request\(s\), ([\d,]+) bytes read", banner) for banner in banners]
    headers = (3 * 512 + 1) * 2 * sum(COUNTS["train"]) + 2 * 512 * len(COUNTS["train"])
    assert sum(int(b.replace(",", "")) for found in read for _, b in found) <= headers, banners
    trained = load_file(out / "model.safetensors")
    for name, value in plain_model_average(model, shards, workflow).items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=name)
