"""Scale benchmark: compile wall time and peak memory (max RSS) against parameter count.

    .venv/bin/python bench/scale_bench.py [--shapes gpt2 tinyllama llama3-8b llama-70b]
        [--full gpt2 tinyllama llama3-8b]

Each shape is a transformers config (no download) in a generated model file, compiled in a fresh
process (its own max RSS), micro-batch 1 x 128 tokens:
- `--plan-only` (stand-ins for the weights, a block's weights at a time): every shape;
- the full compile (`--weights auto`: a model whose parameters take more than 2 GiB is compiled on
  stand-ins into a build without its weights, which the run stages; GPT-2's go into its packages),
  then `cloudless-compile --check` on the build: the shapes named by `--full`.
Printed per run: parameters, weight bytes, path, wall seconds, peak GB, stages planned, the ratio of
peak memory to the weights' bytes, and for a full compile the build's size and whether --check passed.
Issue 29's targets: the 8B compiles in <= 15 min with peak <= 8 GB into a build <= 500 MB that passes
--check, in >= 2 stages; the 1.1B peaks <= 4 GB; a 70B shape plans with peak <= 16 GB; compile time at
most linear in layer count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES: dict[str, tuple[str, dict[str, int | float]]] = {
    "gpt2": ("GPT2", {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}),
    "tinyllama": (
        "Llama",
        {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
         "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048},
    ),
    "llama3-8b": (
        "Llama",
        {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0},
    ),
    "llama-70b": (
        "Llama",
        {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
         "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0},
    ),
}  # fmt: skip
#: a shape's own planning options: the 70B's weights and gradients (526 GB under SGD) need 52 or more
#: functions of 10 GB, one layer each: more stages than the default 16, and than OpenFaaS CE's 15
#: functions (one per stage) allow, so it is planned for Lambda alone
PLAN_OPTIONS: dict[str, list[str]] = {"llama-70b": ["--target", "sam", "--max-stages", "96"]}

MODEL = """
import torch
import transformers
from torch import nn

# SGD: weights and gradients per function (Adam's two more copies would not fit a 70B layer in 10 GB)
TRAINING = {{"global_batch_size": 64, "micro_batch_sizes": [1], "iterations": 100}}
VOCAB = {vocab}


def build_model() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.{family}Config(**{config}, use_cache=False)
    return transformers.{family}{head}(config)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=1e-4)


def example_inputs(batch_size: int):
    return (torch.randint(0, VOCAB, (batch_size, 128), generator=torch.Generator().manual_seed(0)),)


def example_targets(batch_size: int):
    return torch.randint(0, VOCAB, (batch_size, 128), generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB), target.reshape(-1))
"""

#: runs the compile in this process and prints its peak RSS (bytes) last: VmHWM, its memory's high-water
#: mark since exec (rusage's maxrss also holds what a child inherited from its parent at fork)
RUNNER = (
    "import sys\n"
    "from cloudless.compiler.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM'))\n"
    "print('MAXRSS', int(hwm.split()[1]) * 1024, flush=True)\n"
    "sys.exit(code)\n"
)


def model_file(folder: Path, shape: str) -> Path:
    family, config = SHAPES[shape]
    head = "LMHeadModel" if family == "GPT2" else "ForCausalLM"
    path = folder / f"{shape.replace('-', '_')}.py"
    vocab = config["vocab_size"]
    path.write_text(MODEL.format(family=family, head=head, config=repr(config), vocab=vocab))
    return path


def parameter_count(shape: str) -> int:
    import torch
    import transformers

    family, config = SHAPES[shape]
    with torch.device("meta"):
        model = getattr(transformers, f"{family}{'LMHeadModel' if family == 'GPT2' else 'ForCausalLM'}")(
            getattr(transformers, f"{family}Config")(**config)
        )
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def compile_once(path: Path, out: Path, plan_only: bool, options: list[str]) -> dict[str, object]:
    command = [sys.executable, "-c", RUNNER, str(path), "-o", str(out), "-q", "--repeats", "2", *options]
    command += ["--plan-only"] if plan_only else ["--no-verify", "--weights", "auto"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    peak = next((int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("MAXRSS")), 0)
    stages = None
    build_mb: float | None = None
    check = ""
    if result.returncode == 0:
        stages = len(json.loads((out / "plan.json").read_text())["stages"])
        if not plan_only:
            build_mb = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
            checked = subprocess.run(
                [sys.executable, "-m", "cloudless.compiler.cli", "--check", str(out)], capture_output=True, text=True
            )
            check = "passed" if checked.returncode == 0 else "FAILED"
    error = "" if result.returncode == 0 else (result.stderr.strip().splitlines() or ["?"])[-1][:160]
    return {"wall_s": wall, "peak": peak, "stages": stages, "error": error, "build_mb": build_mb, "check": check}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--full", nargs="*", default=["gpt2", "tinyllama", "llama3-8b"], choices=list(SHAPES))
    args = parser.parse_args()
    print(f"{'shape':<10} {'params':>8} {'weights GB':>10} {'path':<9} {'wall s':>7} {'peak GB':>8} "
          f"{'peak/weights':>12} {'stages':>6} {'build MB':>8} {'--check':>7}")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        for shape in args.shapes:
            path = model_file(folder, shape)
            count = parameter_count(shape)
            weights = count * 4
            runs = [("plan-only", True)] + ([("full", False)] if shape in args.full else [])
            for name, plan_only in runs:
                got = compile_once(path, folder / f"{shape}-{name}", plan_only, PLAN_OPTIONS.get(shape, []))
                peak = int(got["peak"])  # type: ignore[call-overload]
                line = (
                    f"{shape:<10} {count / 1e9:>7.2f}B {weights / 1e9:>10.2f} {name:<9} {got['wall_s']:>7.0f} "
                    f"{peak / 1e9:>8.2f} {peak / weights:>12.2f} {got['stages'] or '-':>6}"
                    f" {'-' if got['build_mb'] is None else format(got['build_mb'], '.1f'):>8} {got['check'] or '-':>7}"
                )
                print(line + (f"  error: {got['error']}" if got["error"] else ""), flush=True)


if __name__ == "__main__":
    main()
