"""Nothing read back from storage is trusted blindly, and a diverging run stops.

- A checkpoint with a flipped bit, or truncated, is found out when it is read; the stage falls back
  to its previous checkpoint and replays from there, and the run ends with the same parameters,
  bit for bit, as a run that saw no damage.
- A damaged activation fails the function with the key named (after asking again).
- A run whose loss stops being finite exits 1 with one line naming the iteration and the stage,
  and its metrics.json is valid JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cloudless.ir import protocol
from cloudless.ir.protocol import CorruptBlob
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.storage.channels import DirectoryChannel
from cloudless.runtimes.storage.tensors import unpack
from tests.runtime_cases import front_end, run_workers, write_packages, write_training_data

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 8


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory):
    """Two stages (the second replicated twice), trained clean once: the parameters to match."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("integrity")
    result = front_end()
    n = len(result.chain.blocks)
    workflow = write_packages(
        result, folder / "build", [(0, 0, 1), (1, n - 1, 2)], micro_batch=8, global_batch=32, iterations=ITERATIONS
    )
    assert workflow.run.checkpoint_every == 2
    clean = folder / "clean"
    write_training_data(result, DirectoryChannel(clean), workflow.regions[0].name)
    run_workers(folder / "build", workflow, clean, 0, ITERATIONS, run="r")
    return result, folder / "build", workflow, final_state(clean, workflow)


def final_state(storage: Path, workflow) -> dict[str, torch.Tensor]:
    region = workflow.regions[0]
    ns = protocol.namespace("r", region.name)
    channel = DirectoryChannel(storage)
    state: dict[str, torch.Tensor] = {}
    for function in region.functions:
        state.update(unpack(channel.get(protocol.state_key(ns, function.stage, ITERATIONS), timeout=1)))
    return state


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 40] ^= 0x10  # inside a tensor's bytes, past the header
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


@pytest.mark.parametrize("damage", [flip_a_bit, truncate], ids=["one-bit-flipped", "truncated"])
@pytest.mark.parametrize("stage", [0, 1])
def test_a_damaged_checkpoint_falls_back_and_ends_with_the_same_parameters(
    pipeline, tmp_path: Path, damage, stage: int, capfd: pytest.CaptureFixture[str]
) -> None:
    result, build, workflow, clean = pipeline
    region = workflow.regions[0].name
    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region)
    run_workers(build, workflow, storage, 0, 4, run="r")
    # The next invocations start from the checkpoint of iteration 4, which is now damaged.
    key = protocol.state_key(protocol.namespace("r", region), stage, 4)
    damage(storage / key)
    with pytest.raises(CorruptBlob, match=key):
        DirectoryChannel(storage).try_get(key)
    results = run_workers(build, workflow, storage, 4, ITERATIONS, run="r")
    # The damaged stage's replicas replayed from the checkpoint before (2); the others went on from 4.
    resumed = {(r.stage, r.replica): r.resumed for r in results}
    assert resumed == {(s, k): 2 if s == stage else 4 for s, k in resumed}
    assert f"{key}: corrupt" in capfd.readouterr().err
    got = final_state(storage, workflow)
    assert got.keys() == clean.keys()
    assert all(torch.equal(got[name], clean[name]) for name in clean), "not the clean run's parameters"


@pytest.mark.slow
def test_a_damaged_activation_fails_naming_its_key(pipeline, tmp_path: Path) -> None:
    result, build, workflow, _ = pipeline
    region = workflow.regions[0].name
    damaged = protocol.activation_key(protocol.namespace("r", region), 1, 0, 2)

    class Damaging(DirectoryChannel):
        """Storage that keeps one key with a flipped bit, however often it is written."""

        def _write(self, key: str, blob: bytes) -> None:
            if key == damaged:
                blob = blob[:-1] + bytes([blob[-1] ^ 1])
            super()._write(key, blob)

    storage = tmp_path / "storage"
    write_training_data(result, DirectoryChannel(storage), region)
    with pytest.raises(CorruptBlob, match=f"{damaged}: corrupt"):
        # (the others wait for what the failed one never sends: not long, here)
        run_workers(build, workflow, storage, 0, 3, run="r", channel=Damaging, timeout=2)


@pytest.mark.slow
def test_a_diverging_run_stops_with_one_line_and_valid_metrics(
    compile_cli, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = (ROOT / "samples" / "mlp_digits.py").read_text()
    model = tmp_path / "diverging.py"
    model.write_text(source.replace('"learning_rate": 0.1', '"learning_rate": 1e4'))
    assert '"learning_rate": 1e4' in model.read_text()
    code, _, err = compile_cli(str(model), "-o", str(tmp_path / "build"), "-q", "--repeats", "1")
    assert code == 0, err
    code = run_main([str(tmp_path / "build"), "--iterations", "60", "--run-id", "r", "-q"])
    err = capsys.readouterr().err
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "the run failed: iteration " in lines[0] and "stage 0" in lines[0] and "diverged" in lines[0]

    def no_constants(name: str) -> float:
        raise AssertionError(f"metrics.json holds {name}: not JSON")

    metrics = json.loads((tmp_path / "build" / "run" / "metrics.json").read_text(), parse_constant=no_constants)
    assert metrics["status"] == "failed" and metrics["error"] == lines[0].split("the run failed: ")[1]
    stopped = int(lines[0].split("iteration ")[1].split(":")[0])
    assert len(metrics["progress"]) == stopped < 60  # it stopped there, not at the end
    assert metrics["final_loss"] == metrics["progress"][-1]["loss"]
    assert not (tmp_path / "build" / "run" / "model.safetensors").exists()
