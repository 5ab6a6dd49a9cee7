"""A small CNN on JPEG images read where they lie: WebDataset shards, decoded and augmented in the function.

Data: scikit-learn's bundled handwritten digits (1,797 real 8x8 scans), each written once as a 32x32
grayscale JPEG into WebDataset tar shards beside this file (`data/digits-jpeg/`, about 1 MB; the first
load_shard call writes them, as your own data would already lie in a folder or a bucket). The run never
stages them: the controller reads the shards' index, the first stage reads the shards and runs
`transform`, which decodes each JPEG (Pillow) and crops it at a random offset, every epoch afresh.
No flip: a mirrored digit is another glyph. Put the shards in S3 and return `s3://…` from load_shard to
train on them there (docs/data.md).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch
from torch import nn

TRAINING = {
    "global_batch_size": 64,
    "micro_batch_sizes": [16],
    "iterations": 120,
    "learning_rate": 0.05,
}

SHARDS = Path(__file__).resolve().parent / "data" / "digits-jpeg"
#: per split, its shards and the samples of each: 1,440 to train on, 356 to test on (no image in both)
SPLITS = {"train": (6, 240), "test": (2, 178)}
SIZE, PAD = 32, 3


def write_shards(folder: Path = SHARDS) -> None:
    """The digits as JPEGs in WebDataset shards (`{split}-000000.tar`, ...), written once."""
    import tarfile

    from PIL import Image
    from sklearn.datasets import load_digits

    if all((folder / f"{split}-{count - 1:06d}.tar").is_file() for split, (count, _) in SPLITS.items()):
        return
    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0)).tolist()
    folder.mkdir(parents=True, exist_ok=True)
    position = 0
    for split, (count, per_shard) in SPLITS.items():
        for shard in range(count):
            path = folder / f"{split}-{shard:06d}.tar"
            partial = path.with_suffix(f".tar.{os.getpid()}.partial")  # two processes may write them at once
            with tarfile.open(partial, "w") as tar:
                for _ in range(per_shard):
                    index = order[position]
                    position += 1
                    pixels = (digits.images[index] * 255 / 16).astype("uint8")
                    image = Image.fromarray(pixels).resize((SIZE, SIZE), Image.BILINEAR)
                    encoded = io.BytesIO()
                    image.save(encoded, format="JPEG", quality=90)
                    for extension, data in (("jpg", encoded.getvalue()), ("cls", str(digits.target[index]).encode())):
                        info = tarfile.TarInfo(f"{index:05d}.{extension}")
                        info.size, info.mtime = len(data), 0  # the same bytes on every machine
                        tar.addfile(info, io.BytesIO(data))
            partial.replace(path)


def load_shard(region: str, split: str) -> str:
    write_shards()
    return f"data/digits-jpeg/{split}-{{000000..{SPLITS[split][0] - 1:06d}}}.tar"


def transform(sample: dict, *, epoch: int, index: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    from PIL import Image

    image = Image.open(io.BytesIO(sample["jpg"])).convert("L")
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).reshape(1, SIZE, SIZE)
    padded = nn.functional.pad(pixels.float() / 255, (PAD, PAD, PAD, PAD))
    top, left = torch.randint(0, 2 * PAD + 1, (2,)).tolist()  # seeded per sample and epoch by the run
    return (padded[:, top : top + SIZE, left : left + SIZE],), torch.tensor(int(sample["cls"]))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def example_inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.zeros(batch_size, 1, SIZE, SIZE),)


def example_targets(batch_size: int) -> torch.Tensor:
    return torch.zeros(batch_size, dtype=torch.int64)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=TRAINING["learning_rate"], momentum=0.9)


if __name__ == "__main__":
    write_shards()
    print(f"shards in {SHARDS}")
