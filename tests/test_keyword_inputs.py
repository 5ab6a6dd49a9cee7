"""The Hugging Face conventions without a wrapper: example_inputs returns a dict of keyword arguments
(`model(**inputs)`), the dataset's rows are dicts mapped by name onto them, and the model returns its own loss
(`output.loss`, from `labels=`). A GPT-2 from a config trains as the plain loop `model(**batch).loss` does, in
2 stages x 2 replicas."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cloudless.compiler.frontend.model_file import load_model_file, make_model_optimizer
from cloudless.ir.sample_order import SHUFFLE_SHARDS, ShardOrder, sample_seed
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.function.batches import batch_difference

from .reference import PlainTrainer
from .runtime_cases import compile_pipeline

MODEL = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

TRAINING = {"global_batch_size": 8, "micro_batch_sizes": [2], "iterations": 4, "learning_rate": 0.05}
VOCAB, LENGTH = 64, 12


def build_model():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def example_inputs(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, LENGTH))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=generator)
        self.ids = (start + torch.arange(LENGTH)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def load_shard(region, split):
    return Rows(64 if split == "train" else 16, 0 if split == "train" else 1)
"""


def _plain_loop(model_path: Path, workflow: Workflow) -> tuple[dict[str, torch.Tensor], float]:
    """The loop a user writes: model(**batch).loss over the run's micro-batches (in its sample order), one SGD
    step per global batch; and the trained model's mean test loss over whole micro-batches in order."""
    model_file = load_model_file(model_path)
    rows = model_file.load_shard("r", "train")
    items = [(tuple(rows[i].values()), torch.zeros(0)) for i in range(len(rows))]  # the order's bookkeeping only
    run = workflow.run
    order = PlainTrainer(model_file, run, items, workflow.optimizer, run.iterations)
    model = model_file.build_model()
    optimizer = make_model_optimizer(model_file, list(model.named_parameters()))
    for iteration in range(run.iterations):
        for m in range(run.micro_batches):
            chosen = [rows[i] for i in order.indices(iteration, m)]
            batch = {key: torch.stack([row[key] for row in chosen]) for key in chosen[0]}
            (model(**batch).loss / run.micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    test = model_file.load_shard("r", "test")
    with torch.no_grad():
        losses = [
            float(model(**{k: torch.stack([test[i][k] for i in range(f, f + 2)]) for k in test[0]}).loss)
            for f in range(0, len(test), run.micro_batch)
        ]
    return {k: v.detach() for k, v in model.state_dict().items()}, sum(losses) / len(losses)


@pytest.mark.slow  # a compile and a run
def test_a_keyword_input_model_returning_its_loss_trains_as_the_plain_loop_without_a_wrapper(tmp_path: Path) -> None:
    model = tmp_path / "gpt2_keywords.py"
    build, workflow = compile_pipeline(MODEL, model)
    assert workflow.data.inputs == ("input_ids", "attention_mask", "labels") and workflow.data.targets == 0
    out = tmp_path / "out"
    assert run_main([str(build), "--out", str(out), "--model", str(model), "-q"]) == 0
    trained = load_file(out / "model.safetensors")
    expected, test_loss = _plain_loop(model, workflow)
    for name, value in expected.items():
        if name in trained:  # the tied lm_head.weight is saved once, as transformer.wte.weight
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert "transformer.wte.weight" in trained
    assert json.loads((out / "metrics.json").read_text())["test"]["loss"] == pytest.approx(test_loss, rel=1e-5)


def test_keyword_inputs_that_are_no_parameter_names_are_one_line(model_file, compile_cli, tmp_path) -> None:
    path = model_file(
        textwrap.dedent(MODEL).replace(
            'return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}',
            'return {"input ids": ids}',
            1,
        )
    )
    code, _, stderr = compile_cli(str(path), "-o", str(tmp_path / "b"), "--repeats", "1")
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert "example_inputs(2) returned a dict with the key 'input ids'; expected the names of the forward's" in stderr


IN_PLACE = '''

def load_shard(region, split):
    return "data/" + split + "-0.parquet"


def transform(row, *, epoch, index):
    ids = torch.tensor(row["ids"])
    return {"input_ids": ids, "labels": ids}


def collate_fn(samples):
    """A data collator's dict: padded, the padding masked and left out of the loss."""
    longest = LENGTH  # torch.export traced the model at this length
    batch = {"input_ids": torch.zeros(len(samples), longest, dtype=torch.int64)}
    batch["attention_mask"] = torch.zeros(len(samples), longest, dtype=torch.int64)
    batch["labels"] = torch.full((len(samples), longest), -100)
    for row, sample in enumerate(samples):
        width = len(sample["input_ids"])
        batch["input_ids"][row, :width] = sample["input_ids"]
        batch["attention_mask"][row, :width] = 1
        batch["labels"][row, :width] = sample["labels"]
    return batch
'''


@pytest.mark.slow  # a compile and a run
def test_parquet_rows_collated_into_a_dict_by_a_data_collator_train_as_the_plain_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Data where it lies, as a Hugging Face user brings it: Parquet rows of token ids of several lengths, a
    transform giving a dict per sample, a collate_fn giving the dict a data collator does (padded to the
    sequence length the model was traced at, masked, -100 where no label)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", 96), ("test", 16)):
        start = torch.randint(0, 64, (count, 1), generator=generator)
        widths = torch.randint(6, 13, (count,), generator=generator)  # rows of several lengths
        sequences = ((start + torch.arange(12)) % 64).tolist()
        rows = [{"ids": ids[:w]} for ids, w in zip(sequences, widths.tolist(), strict=True)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / f"{split}-0.parquet", row_group_size=16)
    source = textwrap.dedent(MODEL)
    model = tmp_path / "gpt2_parquet.py"
    build, workflow = compile_pipeline(source[: source.index("class Rows")] + textwrap.dedent(IN_PLACE).lstrip(), model)
    storage = ["--storage", str(tmp_path / "storage")]
    assert run_main([str(build), "--out", str(tmp_path / "out"), "--model", str(model), "-q", *storage]) == 0
    run = workflow.run

    spec = importlib.util.spec_from_file_location("gpt2_parquet_plain", model)
    assert spec is not None and spec.loader is not None
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    file = pq.ParquetFile(tmp_path / "data" / "train-0.parquet")
    groups = [file.read_row_group(g).to_pylist() for g in range(file.num_row_groups)]
    order = ShardOrder(tuple(len(rows) for rows in groups), run.seed, SHUFFLE_SHARDS)
    net = user.build_model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    for iteration in range(run.iterations):
        for m in range(run.micro_batches):
            samples = []
            for located in order.span(iteration * run.global_batch + m * run.micro_batch, run.micro_batch):
                torch.manual_seed(sample_seed(run.seed, located.epoch, located.index))
                samples.append(
                    user.transform(groups[located.shard][located.row], epoch=located.epoch, index=located.index)
                )
            batch = user.collate_fn(samples)
            (net(**batch).loss / run.micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = load_file(tmp_path / "out" / "model.safetensors")
    for name, value in net.state_dict().items():
        if name in trained:
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=name)

    # padded to each batch's longest instead: the first stage says what the traced model takes, in one line
    assert workflow.data.fixed_shapes  # torch.export traced it
    padded = tmp_path / "padded"
    padded.mkdir()
    (padded / "data").symlink_to(tmp_path / "data")
    source = model.read_text().replace("longest = LENGTH", 'longest = max(len(s["input_ids"]) for s in samples)')
    build, _ = compile_pipeline(source, padded / "gpt2_parquet.py")
    capsys.readouterr()
    argv = [str(build), "--out", str(padded / "out"), "-q", "--storage", str(padded / "storage")]
    assert run_main([*argv, "--model", str(padded / "gpt2_parquet.py")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "collate_fn on stage 0: inputs 0 is int64 [2, " in line, line
    assert "but torch.export traced the model at example_inputs's [2, 12]" in line, line


def test_a_collated_batch_of_other_sizes_than_a_fixed_shape_trace_is_named() -> None:
    example = [torch.zeros(2, 12, dtype=torch.int64)]
    padded = [torch.zeros(2, 9, dtype=torch.int64)]
    assert batch_difference("inputs", padded, example, 2) is None  # fx: any width
    found = batch_difference("inputs", padded, example, 2, fixed_shapes=True)
    assert found is not None and found.startswith("inputs 0 is int64 [2, 9], but torch.export traced the model at")
    assert batch_difference("inputs", example, example, 2, fixed_shapes=True) is None
