"""A small attention model over text of every length, read where it lies: Parquet rows, padded per batch.

Data: lines of Python's own standard library (real text, on every machine with Python), each labelled by
Python's tokenizer as prose (a comment or a docstring line) or code, written once as Parquet files beside
this file (`data/stdlib-lines/`, row groups of 256 rows, as pyarrow and Hugging Face `datasets` write
them; the first load_shard call writes them). The run never stages them: the controller reads the files'
footers, the first stage reads row groups and runs `transform` (the line's UTF-8 bytes as tokens, a
random span of at most 96 of them, every epoch afresh) and `collate_fn`, which pads each micro-batch to its
longest line and masks the padding. Put the files in S3 and return `s3://…` from load_shard to train on
them there (docs/data.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

TRAINING = {
    "global_batch_size": 64,
    "micro_batch_sizes": [16],
    "iterations": 150,
    "learning_rate": 0.003,
}

FILES = Path(__file__).resolve().parent / "data" / "stdlib-lines"
#: the standard library's modules the lines come from: the last one's are the test split
MODULES = {"train": ("argparse", "textwrap", "json/decoder", "csv", "calendar", "fractions"), "test": ("difflib",)}
LONGEST, WIDTH, PROSE, CODE = 96, 64, 1, 0


def stdlib_lines(module: str) -> list[dict]:
    """A module's lines of prose (comments, docstring lines) and of code, `{"text": ..., "label": ...}`, as
    many of each (the file's order), lines shorter than 8 characters left out."""
    import io
    import sysconfig
    import tokenize

    source = (Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py").read_text(encoding="utf-8")
    prose, prose_lines = [], set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            prose.append(token.string.lstrip("#").strip())
            prose_lines.add(token.start[0])
        elif token.type == tokenize.STRING and token.string.endswith(('"""', "'''")):
            lines = [line.strip().strip("\"'") for line in token.string.splitlines()]
            prose += [line for line in lines if not line.startswith((">>>", "..."))]  # not doctests' code
            prose_lines.update(range(token.start[0], token.end[0] + 1))
    code = [line.strip() for n, line in enumerate(source.splitlines(), 1) if n not in prose_lines]
    prose, code = [t for t in prose if len(t) >= 8], [t for t in code if len(t) >= 8]
    kept = min(len(prose), len(code))
    rows = [{"text": t, "label": PROSE} for t in prose[:kept]] + [{"text": t, "label": CODE} for t in code[:kept]]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(len(rows))).tolist()
    return [rows[i] for i in order]


def write_files(folder: Path = FILES) -> None:
    """Each split's lines as a Parquet file, `{split}.parquet`, written once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, modules in MODULES.items():
        path = folder / f"{split}.parquet"
        if path.is_file():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        rows = [row for module in modules for row in stdlib_lines(module)]
        partial = path.with_suffix(f".parquet.{os.getpid()}.partial")  # two processes may write it at once
        pq.write_table(pa.Table.from_pylist(rows), partial, row_group_size=256)
        partial.replace(path)


def load_shard(region: str, split: str) -> str:
    write_files()
    return f"data/stdlib-lines/{split}.parquet"


def transform(row: dict, *, epoch: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor(list(row["text"].encode("utf-8")), dtype=torch.int64) + 1  # 0 is padding
    if len(tokens) > LONGEST:  # a random span of a long line: seeded per sample and epoch by the run
        start = int(torch.randint(0, len(tokens) - LONGEST + 1, ()))
        tokens = tokens[start : start + LONGEST]
    return tokens, torch.tensor(row["label"])


def collate_fn(samples: list) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Pad to the micro-batch's longest line; the mask says which tokens are text."""
    longest = max(len(tokens) for tokens, _ in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest)
    for row, (line, _) in enumerate(samples):
        tokens[row, : len(line)], mask[row, : len(line)] = line, 1
    return (tokens, mask), torch.stack([label for _, label in samples])


class Attention(nn.Module):
    """One head of self-attention over the tokens the mask keeps, with a residual MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.norm, self.mlp = nn.LayerNorm(WIDTH), nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU())
        self.out = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.query(x) @ self.key(x).transpose(1, 2) / WIDTH**0.5
        scores = scores.masked_fill(mask.unsqueeze(1) == 0, float("-inf"))
        x = self.norm(x + scores.softmax(-1) @ self.value(x))
        return x + self.out(self.mlp(x))


class LineClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.positions = nn.Embedding(257, WIDTH), nn.Embedding(LONGEST, WIDTH)
        self.first, self.second = Attention(), Attention()
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.bytes(tokens) + self.positions(positions)
        x = self.second(self.first(x, mask), mask)
        pooled = (x * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)  # the mean over the text
        return self.head(pooled)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return LineClassifier()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(batch_size, LONGEST, dtype=torch.int64), torch.ones(batch_size, LONGEST)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.zeros(batch_size, dtype=torch.int64)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=TRAINING["learning_rate"])


if __name__ == "__main__":
    write_files()
    print(f"Parquet files in {FILES}")
