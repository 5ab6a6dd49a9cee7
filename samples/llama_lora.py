"""Fine-tuning recipe: LoRA on a small Llama (transformers config, no download), the way fine-tuning
scripts train one, on the real text of llama_text.py (Python's own pydoc topics, byte tokens).

- Model: llama_text.py's Llama (4 layers, width 128, 0.66M parameters) with peft's LoRA (rank 8) on
  every attention and MLP projection; the embedding and the output head are trained whole
  (`modules_to_save`, as a recipe does for a new vocabulary). Everything else is frozen: 0.13M of the
  0.83M parameters train, and only those are synced, checkpointed and held in optimizer state.
- Optimizer: AdamW in parameter groups chosen by name, as transformers' Trainer chooses them: weight
  decay on matrices, none on biases, norms or embeddings, and the LoRA B matrices at 4x the rate of
  the rest (LoRA+).
- Schedule: linear warm-up over the first 10% of the iterations, then cosine decay to 10%.
- Gradient clipping to a global norm of 1.0 over every stage; bf16 mixed precision (CPU autocast;
  activations cross stages in bfloat16).

The base model is a freshly initialised one (nothing is downloaded): in a real fine-tune,
build_model() would load a checkpoint into it. The run writes the adapter as peft saves it
(OUT/adapter/: adapter_model.safetensors, adapter_config.json), loadable with
`PeftModel.from_pretrained(base_model, "OUT/adapter")`, besides model.safetensors (the whole model).

Loss target: LOSS_TARGET nats per byte on the test split after TRAINING's iterations; a uniform
guess is ln 256 = 5.55 and the bigram's conditional entropy 2.45 (see llama_text.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from llama_text import CONTEXT, VOCAB_SIZE, example_inputs, example_targets, load_shard, loss_fn
from llama_text import build_model as build_base_model
from peft import LoraConfig, get_peft_model
from torch import nn

__all__ = ["example_inputs", "example_targets", "load_shard", "loss_fn", "CONTEXT", "VOCAB_SIZE"]

LEARNING_RATE = 3e-3
WARMUP_SHARE = 0.1

TRAINING = {
    "global_batch_size": 32,
    "micro_batch_sizes": [8, 16],
    "iterations": 200,
    "learning_rate": LEARNING_RATE,
    "max_grad_norm": 1.0,
    "precision": "bf16-mixed",
}

#: the test loss (nats per byte) a run of TRAINING["iterations"] must reach (measured: 2.29)
LOSS_TARGET = 2.5


def build_model() -> nn.Module:
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        modules_to_save=["embed_tokens", "lm_head"],
    )
    return get_peft_model(build_base_model(), lora)


def make_optimizer(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    decay, no_decay, lora_b = [], [], []
    for name, parameter in named_parameters:
        if not parameter.requires_grad:
            continue
        if ".lora_B." in name:
            lora_b.append(parameter)
        elif parameter.ndim < 2 or "norm" in name or "embed_tokens" in name:
            no_decay.append(parameter)
        else:
            decay.append(parameter)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.01},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": lora_b, "weight_decay": 0.01, "lr": 4 * LEARNING_RATE},
        ],
        lr=LEARNING_RATE,
    )


def make_scheduler(optimizer: torch.optim.Optimizer, iterations: int) -> torch.optim.lr_scheduler.LRScheduler:
    warmup = max(1, int(WARMUP_SHARE * iterations))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, iterations - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
