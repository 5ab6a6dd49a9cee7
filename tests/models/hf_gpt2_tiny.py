"""A tiny GPT-2 from a transformers config (no download), use_cache=False: the torch.export path."""

import torch
import transformers
from _shards import ExampleShard, example_shard


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, use_cache=False)
    return transformers.GPT2LMHeadModel(config).train()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 64, (batch_size, 12), generator=torch.Generator().manual_seed(0)),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch_size, 12), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, 64), target.reshape(-1))


def load_shard(region: str, split: str) -> ExampleShard:
    return example_shard(example_inputs, example_targets, split)
