"""The digits MLP of samples/mlp_digits.py, its training data spread unevenly over three regions, for
bench/geo_bench.py with its catalog bench/geo3.yaml: 60% of the train split lies in aws-us-east-1,
25% in aws-eu-west-1 and 15% in aws-ap-southeast-1 (every region holds the whole test split).

The model, data and optimizer are the sample's (samples/mlp_digits.py, imported from there).
"""

import sys
from pathlib import Path

from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "samples"))

from mlp_digits_geo import (  # noqa: F401 - the model file contract, re-exported
    TRAINING,
    build_model,
    example_inputs,
    example_targets,
    loss_fn,
    make_optimizer,
    shard_of,
)

#: share of the train split held in each region (skewed on purpose)
SHARES = {
    "aws-us-east-1": (0.0, 0.60),
    "aws-eu-west-1": (0.60, 0.85),
    "aws-ap-southeast-1": (0.85, 1.0),
}


def load_shard(region: str, split: str) -> Dataset:
    return shard_of(SHARES, region, split)
