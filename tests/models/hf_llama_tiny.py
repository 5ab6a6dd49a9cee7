"""A tiny Llama from a transformers config (no download): the torch.export path.

Its rotary embedding runs under torch.no_grad() inside forward, which torch.export turns into a
`wrap_with_set_grad_enabled` higher-order op over a sub-graph module.
"""

import zlib

import torch
import transformers
from torch.utils.data import Dataset

VOCAB_SIZE = 256
CONTEXT = 12

TRAINING = {
    "global_batch_size": 8,
    "micro_batch_sizes": [2, 4],
    "iterations": 2,
    "learning_rate": 0.01,
}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).train()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB_SIZE, (batch_size, CONTEXT), generator=torch.Generator().manual_seed(0)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (batch_size, CONTEXT), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB_SIZE), target.reshape(-1))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=TRAINING["learning_rate"], momentum=0.9)


class _Tokens(Dataset):
    """Random token sequences; the target is the next token."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        return (self.tokens[i, :-1],), self.tokens[i, 1:]


def load_shard(region: str, split: str) -> Dataset:
    seed = zlib.crc32(f"{region}/{split}".encode())
    samples = 32 if split == "train" else 8
    return _Tokens(torch.randint(0, VOCAB_SIZE, (samples, CONTEXT + 1), generator=torch.Generator().manual_seed(seed)))
