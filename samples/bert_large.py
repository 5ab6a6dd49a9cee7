"""BERT-large (24 layers, 1024 hidden, 16 heads, ~335M parameters) for masked-LM pre-training.

The model is built from a Hugging Face ``transformers.BertConfig`` with freshly
initialised weights (nothing is downloaded); the MLM decoder stays tied to the
word embedding. Data: synthetic. Random 128-token sequences generated from a
seed derived (via zlib.crc32) from (region, split), with ~15% of positions
replaced by [MASK]; labels hold the original token there and -100 elsewhere.
"""

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import transformers
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

SEQ_LEN = 128
VOCAB_SIZE = 30522
MASK_TOKEN_ID = 103  # [MASK] in the bert-base-uncased vocabulary
FIRST_WORD_ID = 1000  # ids below this are special tokens and [unused] slots
MASK_PROB = 0.15
SHARD_SIZE = 256

TRAINING = {
    "global_batch_size": 64,
    "micro_batch_sizes": [1, 2, 4],
    "iterations": 100,
    "learning_rate": 1e-4,
}


def _batch(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Return (input_ids, attention_mask, token_type_ids, labels), each (n, SEQ_LEN)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(FIRST_WORD_ID, VOCAB_SIZE, (n, SEQ_LEN), generator=gen)
    masked = torch.rand(n, SEQ_LEN, generator=gen) < MASK_PROB
    input_ids = tokens.masked_fill(masked, MASK_TOKEN_ID)
    labels = tokens.masked_fill(~masked, -100)
    attention_mask = torch.ones(n, SEQ_LEN, dtype=torch.int64)
    token_type_ids = torch.zeros(n, SEQ_LEN, dtype=torch.int64)
    return input_ids, attention_mask, token_type_ids, labels


class MaskedLMShard(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        *self.inputs, self.labels = _batch(n, seed)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        return tuple(t[i] for t in self.inputs), self.labels[i]


def build_model() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
        attn_implementation="eager",  # plain matmul/softmax attention, easy to trace
    )
    return transformers.BertForMaskedLM(config).train()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return _batch(batch_size, seed=0)[:3]


def example_targets(batch_size: int) -> torch.Tensor:
    return _batch(batch_size, seed=0)[3]


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    # Accept a MaskedLMOutput (a Mapping), a plain dict, a tuple or bare logits.
    if isinstance(output, Mapping):
        logits = output["logits"]
    elif isinstance(output, (tuple, list)):
        logits = output[0]
    else:
        logits = output
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100)


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=TRAINING["learning_rate"])


def load_shard(region: str, split: str) -> MaskedLMShard:
    return MaskedLMShard(SHARD_SIZE, zlib.crc32(f"{region}/{split}".encode()))
