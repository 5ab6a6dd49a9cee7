"""The scatter-reduce through storage: every replica ends with the same bits, the sum in replica order."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cloudless.runtimes.function.scatter_reduce import scatter_reduce
from cloudless.runtimes.storage.channels import DirectoryChannel, KeyTimeout


def reduce_among(root: Path, grads: list[torch.Tensor], pipelined: bool, **options: int) -> list[torch.Tensor]:
    """Every replica's result, each replica on its own thread over one folder."""
    channel = DirectoryChannel(root)
    n = len(grads)
    options = {"piece_bytes": 64, "max_pieces": 4, **options}
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [
            pool.submit(scatter_reduce, channel, "sync", g, i, n, pipelined=pipelined, timeout=30.0, **options)
            for i, g in enumerate(grads)
        ]
        return [f.result() for f in futures]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sequential"])
@pytest.mark.parametrize("replicas", [3, 4])
@pytest.mark.parametrize("numel", [1000, 257, 2], ids=["even", "not-divisible", "fewer-than-replicas"])
def test_every_replica_gets_the_sum(tmp_path: Path, replicas: int, numel: int, pipelined: bool) -> None:
    generator = torch.Generator().manual_seed(replicas * 1000 + numel)
    grads = [torch.randn(numel, generator=generator) * 10 ** (i - 1) for i in range(replicas)]
    expected = grads[0].clone()
    for g in grads[1:]:
        expected += g
    results = reduce_among(tmp_path, grads, pipelined)
    for result in results:
        assert result.shape == expected.shape and result.dtype == expected.dtype
        torch.testing.assert_close(result, expected, rtol=0, atol=0)
        assert torch.equal(result, results[0])


@pytest.mark.parametrize("in_flight", [1, 2])
def test_any_number_of_requests_in_flight_gives_the_same_bits(tmp_path: Path, in_flight: int) -> None:
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(5003, generator=generator) for _ in range(4)]
    expected = grads[0] + grads[1] + grads[2] + grads[3]
    for result in reduce_among(tmp_path, grads, True, in_flight=in_flight, piece_bytes=512, max_pieces=16):
        torch.testing.assert_close(result, expected, rtol=0, atol=0)


def test_one_replica_keeps_its_gradient(tmp_path: Path) -> None:
    flat = torch.arange(5.0)
    assert scatter_reduce(DirectoryChannel(tmp_path), "k", flat, 0, 1, piece_bytes=64, max_pieces=4) is flat


def test_a_missing_replica_times_out_without_hanging(tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(KeyTimeout):
        channel = DirectoryChannel(tmp_path)
        scatter_reduce(channel, "k", torch.ones(1000), 0, 3, piece_bytes=64, max_pieces=4, timeout=0.3)
    assert time.monotonic() - began < 30  # it timed out, and did not wait forever
