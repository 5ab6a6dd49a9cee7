"""Robust profiling (issue 16): the fastest-run statistic, the repeat-until-stable rule and the
warnings, on injected timings (nothing here is timed), and the BlockChain's stability figures."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

from cloudless.compiler.frontend import profile
from cloudless.compiler.frontend.chain import ChainRun
from cloudless.compiler.frontend.profile import (
    BUSY_SHARE,
    EXTRA_BUDGET_S,
    MAX_RUNS_FACTOR,
    PROBES_PER_RUN,
    STABLE_SHARE,
    UNSTABLE_SHARE,
    Probe,
    ProfileRuns,
    apply_runs,
    block_times,
    fastest_gap,
    loss_function,
    needs_another_run,
    profile_blocks,
    profile_warnings,
    repeat_until_stable,
)
from cloudless.compiler.pipeline import FrontEndOptions, run_front_end
from cloudless.ir import Block, BlockChain, MachineInfo
from cloudless.ir.blocks import ProfileStability
from cloudless.ir.schema import SchemaError

from .conftest import ROOT, SAMPLES

OLD_BLOCKS_JSON = ROOT / "tests" / "golden" / "mlp_digits" / "ir" / "blocks.json"


# --- the statistic ------------------------------------------------------------------------------------


def test_fastest_gap_is_the_relative_gap_between_the_two_smallest_samples() -> None:
    assert fastest_gap([3.0, 1.0, 1.25, 9.0]) == pytest.approx(0.25)
    assert fastest_gap([1.0, 1.0]) == 0.0
    assert fastest_gap([2.0]) == 0.0  # one sample confirms nothing, and claims no spread either


def test_block_time_is_its_fastest_run_and_resists_interference_the_median_follows() -> None:
    cost = [0.010, 0.020, 0.030]
    # Interference only adds: two of three runs slowed (by another process) on different blocks.
    added = [[0.0, 0.0, 0.0], [0.005, 0.040, 0.0], [0.008, 0.0, 0.030]]
    runs = [[c + a for c, a in zip(cost, extra, strict=True)] for extra in added]
    assert block_times(runs) == pytest.approx(cost)
    # what the old statistic made of the same runs: the second block's median is slowed
    medians = [statistics.median(column) for column in zip(*runs, strict=True)]
    assert medians[0] == pytest.approx(0.015)


# --- the stop rule ----------------------------------------------------------------------------------


def test_stop_rule_runs_the_requested_runs_then_stops_when_the_fastest_two_agree() -> None:
    assert needs_another_run([], 3, 0.0)
    assert needs_another_run([1.0, 1.0], 3, 0.0)  # the requested three first, however close
    assert not needs_another_run([1.0, 1.0 + STABLE_SHARE / 2, 5.0], 3, 0.0)
    assert needs_another_run([1.0, 1.0 + 2 * STABLE_SHARE, 5.0], 3, 0.0)


def test_stop_rule_needs_two_runs_even_when_one_is_asked_for() -> None:
    assert needs_another_run([1.0], 1, 0.0)
    assert not needs_another_run([1.0, 1.05], 1, 0.0)
    assert needs_another_run([1.0, 2.0], 1, 0.0)
    assert not needs_another_run([1.0, 2.0, 3.0], 1, 0.0)  # the cap: 3 x 1 runs


def test_stop_rule_stops_at_the_cap_and_at_the_time_budget() -> None:
    disagreeing = [1.5**i for i in range(20)]  # each run slower than the last: no two agree
    cap = MAX_RUNS_FACTOR * 3
    assert needs_another_run(disagreeing[: cap - 1], 3, 0.0)
    assert not needs_another_run(disagreeing[:cap], 3, 0.0)
    assert needs_another_run(disagreeing[:4], 3, EXTRA_BUDGET_S - 1)
    assert not needs_another_run(disagreeing[:4], 3, EXTRA_BUDGET_S)
    assert not needs_another_run(disagreeing[:4], 3, EXTRA_BUDGET_S - 1, run_s=2.0)  # one more would not fit


def scripted(totals: list[float], blocks: int = 2) -> Callable[[], tuple[list[float], list[float]]]:
    """A run_once returning, call by call, per-block times summing to each total (the first call is
    the warm-up)."""
    calls: Iterator[float] = iter(totals)

    def run_once() -> tuple[list[float], list[float]]:
        total = next(calls)
        share = total / (2 * blocks)
        return [share] * blocks, [share] * blocks

    return run_once


def probes(wall_s: float = 0.05, cpu_s: float = 0.1) -> Callable[[], Probe]:
    return lambda: Probe(wall_s, cpu_s)


def test_repeat_until_stable_drops_the_warm_up_and_stops_once_stable() -> None:
    runs = repeat_until_stable(scripted([50.0, 1.0, 1.3, 1.04, 9.0]), probes(), repeats=3)
    assert runs.totals == pytest.approx([1.0, 1.3, 1.04])
    assert len(runs.probes) == PROBES_PER_RUN * 3


def test_repeat_until_stable_repeats_until_the_fastest_two_agree() -> None:
    runs = repeat_until_stable(scripted([50.0, 1.0, 1.5, 1.4, 1.3, 1.05, 9.0]), probes(), repeats=3)
    assert runs.totals == pytest.approx([1.0, 1.5, 1.4, 1.3, 1.05])


def test_repeat_until_stable_gives_up_at_the_cap_and_the_chain_records_the_spread() -> None:
    totals = [1.5**i for i in range(20)]
    runs = repeat_until_stable(scripted([50.0, *totals]), probes(), repeats=3)
    assert len(runs.totals) == MAX_RUNS_FACTOR * 3
    chain = apply_runs(toy_chain(), runs, repeats=3)
    assert chain.stability is not None
    assert (chain.stability.runs, chain.stability.spread) == (9, 0.5)
    assert chain.profile_repeats == 3


def test_repeat_until_stable_stops_extra_runs_at_the_time_budget() -> None:
    ticks = iter(range(0, 10**6, 20))  # each run takes 20 s on this clock
    runs = repeat_until_stable(
        scripted([50.0, *[1.5**i for i in range(20)]]), probes(), repeats=3, clock=lambda: float(next(ticks))
    )
    # 3 requested, then extra runs while one more like the last fits in the budget (30 s): one
    assert len(runs.totals) == 4


def test_a_warm_up_longer_than_the_budget_counts_as_a_run() -> None:
    """A big model planned from shapes takes minutes a run: its warm-up is not thrown away."""
    ticks = iter(range(0, 10**6, 40))  # each run takes 40 s on this clock
    totals = [10.0, 10.2, 30.0, 40.0]
    runs = repeat_until_stable(scripted(totals), probes(), repeats=2, clock=lambda: float(next(ticks)))
    assert runs.totals == pytest.approx([10.0, 10.2])
    assert len(runs.probes) == PROBES_PER_RUN * 2


# --- filling the chain -----------------------------------------------------------------------------


def toy_chain(blocks: int = 2) -> BlockChain:
    return BlockChain(
        model="toy.py",
        batch_size=4,
        blocks=[Block(i, i, i, [f"n{i}"], [f"m{i}"], 1000, 16, 0, 8, 8, 8) for i in range(blocks)],
        shared_params={},
    )


def test_apply_runs_fills_fastest_times_fastest_matmul_and_its_cpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profile, "usable_threads", lambda: 2)
    runs = ProfileRuns(
        forward_s=[[0.3, 0.2], [0.1, 0.4], [0.2, 0.25]],
        backward_s=[[0.6, 0.5], [0.7, 0.3], [0.5, 0.9]],
        # the fastest matmul (0.04 s) used 0.06 s of CPU on 2 threads: 75% of what they could use
        probes=[Probe(0.05, 0.1), Probe(0.04, 0.06), Probe(0.08, 0.16)],
    )
    chain = apply_runs(toy_chain(), runs, repeats=3)
    assert [(b.forward_s, b.backward_s) for b in chain.blocks] == [(0.1, 0.5), (0.2, 0.3)]
    assert chain.machine is not None
    assert chain.machine.reference_gflops == pytest.approx(2 * 1024**3 / 0.04 / 1e9, rel=1e-4)
    # run totals 1.6, 1.5, 1.85: the fastest two 6.67% apart; matmuls 0.04 s and 0.05 s: 25%
    assert chain.stability == ProfileStability(runs=3, spread=0.0667, reference_spread=0.25, cpu_share=0.75)


def test_profile_blocks_plans_with_the_fastest_run_of_each_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real profile_blocks on a traced model, with the chain runner's times injected."""
    front = run_front_end(FrontEndOptions(SAMPLES / "mlp_digits.py", num_blocks=2, profile_repeats=0))
    blocks = len(front.chain.blocks)
    # warm-up, then three runs whose fastest two disagree by 50%, then two that agree with the first
    script = iter([10.0, 1.0, 1.5, 2.0, 1.2, 1.02, 7.0])
    calls = []

    def fake_run_chain(stages, signatures, inputs, loss_of) -> ChainRun:  # type: ignore[no-untyped-def]
        calls.append(len(stages))
        scale = next(script)
        return ChainRun(torch.tensor(0.0), (), [scale * (i + 1) for i in range(blocks)], [scale] * blocks)

    monkeypatch.setattr(profile, "run_chain", fake_run_chain)
    monkeypatch.setattr(profile, "time_probe", lambda a, b: Probe(0.05, 0.1))
    monkeypatch.setattr(profile, "usable_threads", lambda: 2)
    flat = pytree.tree_leaves(front.example_inputs)
    loss_of = loss_function(front.program.out_spec, front.model_file.loss_fn, front.example_targets)
    chain = profile_blocks(front.program, front.graph, front.chain, flat, loss_of, repeats=3)
    assert calls == [blocks] * 6  # one stage per block; the warm-up and five timed runs
    assert [(b.forward_s, b.backward_s) for b in chain.blocks] == [(1.0 * (i + 1), 1.0) for i in range(blocks)]
    assert chain.stability is not None and chain.stability.runs == 5
    assert chain.stability.spread == 0.02
    assert profile_warnings(chain) == []


def test_profile_blocks_measures_a_real_model_with_a_stability_record() -> None:
    front = run_front_end(FrontEndOptions(SAMPLES / "mlp_digits.py", num_blocks=2, profile_repeats=1))
    s = front.chain.stability
    assert s is not None and 2 <= s.runs <= 3  # one asked for; agreement needs two
    assert s.cpu_share > 0 and s.spread >= 0 and s.reference_spread >= 0
    assert all(b.forward_s > 0 and b.backward_s > 0 for b in front.chain.blocks)
    BlockChain.from_json(json.loads(json.dumps(front.chain.to_json())))  # valid against the schema


# --- warnings ---------------------------------------------------------------------------------------


def measured_chain(spread: float = 0.02, reference_spread: float = 0.01, cpu_share: float = 0.97) -> BlockChain:
    chain = toy_chain()
    chain.machine = MachineInfo(50.0, 2, 2, "test")
    chain.profile_repeats = 3
    chain.stability = ProfileStability(9, spread, reference_spread, cpu_share)
    return chain


def test_no_warning_for_a_stable_profile_or_one_without_figures() -> None:
    assert profile_warnings(measured_chain()) == []
    assert profile_warnings(measured_chain(spread=UNSTABLE_SHARE, reference_spread=UNSTABLE_SHARE)) == []
    assert profile_warnings(measured_chain(cpu_share=BUSY_SHARE)) == []
    older = measured_chain(spread=0.9)
    older.stability = None
    assert profile_warnings(older) == []


def test_warning_when_the_fastest_runs_disagree() -> None:
    (warning,) = profile_warnings(measured_chain(spread=0.35))
    assert warning.startswith("the profile is unstable: the two fastest of 9 runs of the model differ by 35%")
    assert "--profile BUILD/ir/blocks.json" in warning


def test_warning_when_the_reference_matmuls_disagree() -> None:
    (warning,) = profile_warnings(measured_chain(reference_spread=0.4))
    assert warning.startswith("the profile is unstable: the two fastest reference matmuls differ by 40%")


def test_warning_when_the_machine_was_busy_says_by_how_much() -> None:
    (warning,) = profile_warnings(measured_chain(cpu_share=0.5))
    assert warning.startswith("the profile was measured on a busy machine: the fastest reference matmul (50.0 GFLOP/s)")
    assert "got 50% of the CPU time" in warning and "at least 2.0x" in warning


def test_every_reason_in_one_line_for_a_reused_profile_advising_to_profile_again(tmp_path: Path) -> None:
    (warning,) = profile_warnings(
        measured_chain(spread=0.5, reference_spread=0.3, cpu_share=0.3), reused_from=tmp_path / "blocks.json"
    )
    assert warning.startswith("the reused profile ") and "blocks.json was measured on a busy machine" in warning
    assert "differ by 50%" in warning and "differ by 30%" in warning and "at least 3.3x" in warning
    assert warning.endswith("Profile again on an idle machine (omit --profile)")


# --- blocks.json --------------------------------------------------------------------------------------


def test_stability_round_trips_and_saves_deterministically(tmp_path: Path) -> None:
    chain = measured_chain(spread=0.1234, reference_spread=0.05, cpu_share=0.9)
    chain.save(tmp_path / "a.json")
    loaded = BlockChain.load(tmp_path / "a.json")
    assert loaded == chain
    loaded.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert json.loads((tmp_path / "a.json").read_text())["stability"] == {
        "runs": 9,
        "spread": 0.1234,
        "reference_spread": 0.05,
        "cpu_share": 0.9,
    }


def test_an_earlier_blocks_json_without_stability_loads_and_saves_unchanged(tmp_path: Path) -> None:
    assert "stability" not in json.loads(OLD_BLOCKS_JSON.read_text())
    chain = BlockChain.load(OLD_BLOCKS_JSON)
    assert chain.stability is None
    chain.save(tmp_path / "blocks.json")
    assert (tmp_path / "blocks.json").read_bytes() == OLD_BLOCKS_JSON.read_bytes()


def test_the_schema_rejects_a_malformed_stability() -> None:
    document = measured_chain().to_json()
    document["stability"]["extra"] = 1
    with pytest.raises(SchemaError, match="stability"):
        BlockChain.from_json(document)
    document = measured_chain().to_json()
    del document["stability"]["cpu_share"]
    with pytest.raises(SchemaError, match="stability"):
        BlockChain.from_json(document)


# --- the command line ---------------------------------------------------------------------------------


def test_compile_prints_the_warnings_of_an_unstable_profile_even_with_q(compile_cli, tmp_path: Path) -> None:
    chain = BlockChain.load(OLD_BLOCKS_JSON)
    chain.stability = ProfileStability(runs=9, spread=0.35, reference_spread=0.01, cpu_share=0.95)
    chain.save(tmp_path / "blocks.json")
    build = tmp_path / "build"
    code, stdout, stderr = compile_cli(
        str(SAMPLES / "mlp_digits.py"), "-o", str(build), "-q", "--target", "openfaas",
        "--profile", str(tmp_path / "blocks.json"),
    )  # fmt: skip
    assert code == 0, stderr
    assert stdout == ""
    # (other passes may warn too, about other things)
    lines = [line for line in stderr.splitlines() if "profile" in line]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("cloudless-compile: warning: the reused profile ")
    assert "differ by 35%" in lines[0] and "omit --profile" in lines[0]
    # the build keeps the figures its times came with
    assert BlockChain.load(build / "ir" / "blocks.json").stability == chain.stability
