"""A tiny BERT from a transformers config (no download): the torch.export path."""

import torch
import transformers
from _shards import ExampleShard, example_shard


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return transformers.BertForMaskedLM(config).train()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (batch_size, 12), generator=g)
    return ids, torch.ones_like(ids), torch.zeros_like(ids)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch_size, 12), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, 64), target.reshape(-1))


def load_shard(region: str, split: str) -> ExampleShard:
    return example_shard(example_inputs, example_targets, split)
