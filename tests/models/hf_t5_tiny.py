"""A tiny T5 (encoder-decoder) from a transformers config (no download), its config's default
use_cache=True: three inputs, and a forward that returns a cache object unless the compiler turns
the cache off (training never reads it). No dropout, so that plain PyTorch draws nothing the
functions draw otherwise."""

import zlib

import torch
import transformers
from torch.utils.data import Dataset

VOCAB_SIZE = 64
SOURCE, TARGET = 6, 5


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB_SIZE,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,  # T5's attention drops out with a functional call, which the test's no-dropout wrapper misses
    )
    return transformers.T5ForConditionalGeneration(config).train()


def _batch(seed: int, samples: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(1, VOCAB_SIZE, (samples, SOURCE), generator=g)
    mask = torch.ones(samples, SOURCE, dtype=torch.int64)
    mask[:, -1] = 0  # one padded position
    target = torch.randint(1, VOCAB_SIZE, (samples, TARGET + 1), generator=g)
    return source, mask, target[:, :-1], target[:, 1:]


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return _batch(0, batch_size)[:3]


def example_targets(batch_size: int) -> torch.Tensor:
    return _batch(0, batch_size)[3]


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB_SIZE), target.reshape(-1))


class _Pairs(Dataset):
    def __init__(self, seed: int, samples: int) -> None:
        self.source, self.mask, self.decoder, self.target = _batch(seed, samples)

    def __len__(self) -> int:
        return len(self.target)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        return (self.source[i], self.mask[i], self.decoder[i]), self.target[i]


def load_shard(region: str, split: str) -> Dataset:
    return _Pairs(zlib.crc32(f"{region}/{split}".encode()), 32 if split == "train" else 8)
