"""GPT-2 small (124M parameters) as a plain-torch decoder-only language model.

12 layers, 12 heads, 768-wide, 50,257-token vocabulary, 128-token context,
learned position embeddings, pre-LayerNorm blocks and an LM head tied to the
token embedding. Data: synthetic. Random token sequences generated from a seed
derived (via zlib.crc32) from (region, split); the target is the next token.
"""

import zlib
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

VOCAB_SIZE = 50257
CONTEXT = 128
N_LAYER = 12
N_HEAD = 12
N_EMBD = 768
DROPOUT = 0.1
SHARD_SIZE = 512

TRAINING = {
    "global_batch_size": 32,
    "micro_batch_sizes": [1, 2, 4],
    "iterations": 100,
    "learning_rate": 3e-4,
}


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.resid_dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Use x.size(i) rather than tuple-unpacking so torch.fx can trace it.
        batch, seq = x.size(0), x.size(1)
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q = q.view(batch, seq, N_HEAD, N_EMBD // N_HEAD).transpose(1, 2)
        k = k.view(batch, seq, N_HEAD, N_EMBD // N_HEAD).transpose(1, 2)
        v = v.view(batch, seq, N_HEAD, N_EMBD // N_HEAD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, N_EMBD)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = nn.Sequential(
            nn.Linear(N_EMBD, 4 * N_EMBD),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * N_EMBD, N_EMBD),
            nn.Dropout(DROPOUT),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB_SIZE, N_EMBD)
        self.wpe = nn.Embedding(CONTEXT, N_EMBD)
        self.drop = nn.Dropout(DROPOUT)
        self.h = nn.Sequential(*[Block() for _ in range(N_LAYER)])
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB_SIZE, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 initialisation: N(0, 0.02) weights, zero biases. The torch
        # default N(0, 1) embedding would make the tied LM head's logits huge.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        return self.lm_head(self.ln_f(self.h(x)))


def _tokens(n: int, seed: int) -> torch.Tensor:
    """n random sequences of CONTEXT + 1 tokens (inputs plus one shifted target)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (n, CONTEXT + 1), generator=gen)


class TokenShard(Dataset):
    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        return (self.tokens[i, :-1],), self.tokens[i, 1:]


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT2()


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (_tokens(batch_size, seed=0)[:, :-1],)


def example_targets(batch_size: int) -> torch.Tensor:
    return _tokens(batch_size, seed=0)[:, 1:]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=TRAINING["learning_rate"])


def load_shard(region: str, split: str) -> TokenShard:
    return TokenShard(_tokens(SHARD_SIZE, zlib.crc32(f"{region}/{split}".encode())))
