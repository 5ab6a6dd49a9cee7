"""The digits MLP of mlp_digits.py, with its training data spread over two regions: 70% of the
train split lies in aws-us-east-1, 30% in aws-eu-west-1 (both hold the whole test split).

Compile across both regions: `cloudless-compile samples/mlp_digits_geo.py -o build/ --regions
aws-us-east-1,aws-eu-west-1 --objective time --sync model-average` (or `--sync asgd-ga`).
"""

from mlp_digits import (  # noqa: F401 - the model file contract, re-exported
    TRAINING,
    _DigitsDataset,
    _split,
    build_model,
    example_inputs,
    example_targets,
    loss_fn,
    make_optimizer,
)
from torch.utils.data import Dataset

#: share of the train split held in each region
SHARES = {"aws-us-east-1": (0.0, 0.7), "aws-eu-west-1": (0.7, 1.0)}


def load_shard(region: str, split: str) -> Dataset:
    images, labels = _split(split)
    if split != "train":
        return _DigitsDataset(images, labels)
    low, high = SHARES.get(region, (0.0, 0.0))
    first, last = round(low * len(images)), round(high * len(images))
    return _DigitsDataset(images[first:last], labels[first:last])
