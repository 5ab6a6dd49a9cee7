"""The generated packages train for real: pipelined, replicated, through a storage folder."""

from __future__ import annotations

import pytest
import torch

from cloudless.ir.protocol import state_key
from cloudless.runtimes.storage.channels import DirectoryChannel
from cloudless.runtimes.storage.tensors import unpack
from tests.runtime_cases import front_end, reference_training, run_workers, write_packages, write_training_data


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipelined_replicated_run_matches_plain_pytorch(tmp_path, schedule: str) -> None:
    torch.set_num_threads(1)
    result = front_end()
    n_blocks = len(result.chain.blocks)
    assert n_blocks >= 3
    stages = [(0, 0, 2), (1, n_blocks - 2, 3), (n_blocks - 1, n_blocks - 1, 1)]
    workflow = write_packages(
        result, tmp_path / "build", stages, micro_batch=8, global_batch=64, iterations=3, schedule=schedule
    )
    region = workflow.regions[0].name
    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region)
    results = run_workers(tmp_path / "build", workflow, storage, 0, 3)
    losses = [x for r in results if r.stage == 2 for x in r.losses]
    assert len(losses) == 3 * 8 and all(0 < x < 5 for x in losses)

    expected = reference_training(result, workflow, region)
    got: dict[str, torch.Tensor] = {}
    for s in range(len(stages)):
        state = unpack(DirectoryChannel(storage).get(state_key(region, s, 3), timeout=1))
        got.update({k.removeprefix("module/"): v for k, v in state.items() if k.startswith("module/")})
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # Training moved the parameters (so the comparison above is not of untouched weights).
    initial = result.model_file.build_model().state_dict()
    assert any(not torch.allclose(initial[k], expected[k]) for k in expected)
