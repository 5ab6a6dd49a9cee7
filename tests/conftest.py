"""Shared helpers: write a model file into a temporary folder, run the CLI in-process; storage servers
(moto's S3 over HTTP, a real redis-server) for the storage channel tests."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
MODELS = Path(__file__).resolve().parent / "models"


#: Cases of a few seconds each that the default lane leaves to the slow one (`scripts/test.sh --all`, what CI
#: runs): each of their layers keeps a faster case there (the default lane stays under 150 s on 2 cores).
#: By pytest node id, as `--durations` prints them.
SLOW_CASES = frozenset(
    {
        "tests/test_block_bound.py::test_blocks_past_the_bound_end_at_the_layers_ends_and_identical_layers_are_one_key",
        "tests/test_check.py::test_hand_edit_fails_the_check[geo-peer-parameter-missing]",
        "tests/test_check.py::test_hand_edit_fails_the_check[geo-shared-bucket]",
        "tests/test_check.py::test_untouched_build_passes[geo]",
        "tests/test_elastic.py::test_a_deployed_region_may_mark_only_a_peers_missing_contribution_and_departure",
        "tests/test_elastic.py::test_asgd_gas_model_is_the_newest_global_version_even_one_a_region_wrote_before_leaving",
        "tests/test_explain.py::test_report_plan_json_and_summary_say_why",
        "tests/test_fuzz.py::test_catalogs_that_parse_plan_or_fail_with_one_line[fast]",
        "tests/test_fuzz.py::test_invocation_payloads_give_an_invocation_in_bounds_or_a_value_error[fast]",
        "tests/test_fuzz.py::test_mutated_catalogs_parse_or_fail_with_one_line[fast]",
        "tests/test_fuzz.py::test_run_command_lines_fail_fast_with_one_line[fast]",
        "tests/test_geo.py::test_geo_sample_trains_across_regions_cheaper_than_any_allowed_single_region",
        "tests/test_golden.py::test_check_command_passes_a_build_and_names_a_broken_key",
        "tests/test_golden.py::test_generated_tree_matches_golden_and_holds_no_credentials[mlp_digits_geo]",
        "tests/test_golden.py::test_generated_tree_matches_golden_and_holds_no_credentials[wide_mlp_time]",
        "tests/test_golden.py::test_two_compiles_are_byte_identical",
        "tests/test_higher_order.py::test_compile_refuses_to_write_a_stage_that_cannot_run",
        "tests/test_library_ops.py::test_the_fresh_interpreter_check_finds_an_op_nothing_imported_registers",
        "tests/test_limits.py::test_the_registry_comes_from_the_catalog_unless_given",
        "tests/test_model_file.py::test_a_loss_holding_a_constant_tensor_writes_it_into_loss_py",
        "tests/test_model_file.py::test_no_build_file_holds_a_path_of_the_compiling_machine",
        "tests/test_peer_stacks.py::test_an_empty_peer_parameter_grants_nothing_and_names_no_bucketless_arn",
        "tests/test_plan.py::test_plan_is_no_worse_than_any_feasible_baseline[flags1]",
        "tests/test_plan.py::test_plan_is_no_worse_than_any_feasible_baseline[flags3]",
        "tests/test_plan_shape.py::test_the_run_length_follows_training_and_the_summary_says_from_where[training0-5-TRAINING['iterations']]",
        "tests/test_planner.py::test_cbc_finds_the_optimum_highs_and_exhaustive_search_find[cost]",
        "tests/test_planner.py::test_pruning_by_a_known_plan_keeps_the_optimum[time-under-budget]",
        "tests/test_planner.py::test_reduced_cost_fixing_keeps_the_optimum[cost]",
        "tests/test_planner_bands.py::test_bands_on_the_benchmark_chain_match_the_whole_program",
        "tests/test_planner_bands.py::test_the_8b_shapes_plan_is_proven_in_few_bands",
        "tests/test_platforms.py::test_a_stack_without_registry_builds_but_warns",
        "tests/test_platforms.py::test_credentials_are_refused",
        "tests/test_platforms.py::test_missing_handler_folder",
        "tests/test_platforms.py::test_state_machine_runs_in_moto[inline-map]",
        "tests/test_preflight.py::test_nothing_starts_when_the_preflight_fails",
        "tests/test_profile_stability.py::test_compile_prints_the_warnings_of_an_unstable_profile_even_with_q",
        "tests/test_recipes.py::test_a_peft_model_plans_its_adapters_as_the_only_trained_parameters",
        "tests/test_recipes.py::test_check_finds_a_frozen_flag_that_does_not_match_the_workflow",
        "tests/test_rehearse_aws.py::test_rehearse_is_refused_with_another_invoker_or_a_stack",
        "tests/test_rehearse_aws.py::test_the_generated_state_machine_catches_a_timeout_and_fails_with_lambdas_error",
        "tests/test_rehearse_openfaas.py::test_a_replica_over_its_memory_limit_is_killed_and_started_again",
        "tests/test_rehearse_openfaas.py::test_a_replica_whose_process_ends_is_restarted_as_kubernetes_restarts_a_container",
        "tests/test_rehearse_openfaas.py::test_an_answer_past_the_watchdogs_write_timeout_never_arrives_and_the_gateway_says_502",
        "tests/test_rehearse_openfaas.py::test_past_exec_timeout_the_watchdog_answers_504_and_the_function_runs_on",
        "tests/test_rehearse_openfaas.py::test_replicas_are_processes_with_their_secrets_environment_and_cpu_share",
        "tests/test_report.py::test_comparison_shows_plan_and_feasible_baselines",
        "tests/test_report.py::test_report_has_three_files_and_is_byte_identical",
        "tests/test_report.py::test_report_imports_no_compiler_or_runtime",
        "tests/test_report.py::test_the_deploy_steps_are_each_targets_from_where_it_runs[ghcr.io/acme]",
        "tests/test_run.py::test_no_verify_build_runs_a_build_edited_by_hand",
        "tests/test_run.py::test_the_clean_up_deletes_only_the_keys_the_run_wrote",
        "tests/test_stand_ins.py::test_plan_only_writes_the_plan_a_full_compile_makes",
        "tests/test_stand_ins.py::test_stand_ins_give_the_graph_and_blocks_the_weights_give[samples/llama_text.py]",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def model_file(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write `source` (dedented) to tmp_path/name and return its path."""

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return path

    return write


@pytest.fixture
def compile_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run cloudless-compile in-process; returns (exit code, stdout, stderr)."""
    from cloudless.compiler.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


# --- storage servers ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a moto server (real HTTP, in a thread on a free port of 127.0.0.1) for the whole session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made-up credentials and region for boto3 (moto accepts any); no profile, no default endpoint."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for variable in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "CLOUDLESS_S3_ENDPOINT"):
        monkeypatch.delenv(variable, raising=False)


@pytest.fixture
def s3_bucket(moto_endpoint: str, aws_env: None) -> str:
    """A new, empty bucket on the moto server (one per test, so tests never see each other's keys)."""
    import boto3

    name = f"cloudless-test-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=name)
    return name


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _start_redis(executable: str, folder: Path) -> tuple[subprocess.Popen[bytes], int] | None:
    """redis-server on a free port once it answers PING; None if it exited (say, the port was taken)."""
    import redis

    port = _free_port()
    command = [executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with (folder / "redis.log").open("wb") as log:
        process = subprocess.Popen([*command, "--dir", str(folder)], stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 10
    try:
        while process.poll() is None:
            try:
                client.ping()
                return process, port
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    _stop(process)
                    pytest.fail(f"redis-server did not answer PING within 10 s:\n{(folder / 'redis.log').read_text()}")
                time.sleep(0.02)
        return None
    finally:
        client.close()


def private_redis(folder: Path) -> tuple[subprocess.Popen[bytes], int, str]:
    """A redis-server of the test's own (one it may stop, fill or restart): (process, port, executable);
    the test is skipped where none is installed."""
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.skip("redis-server is not installed")
    started = _start_redis(executable, folder)
    assert started is not None, (folder / "redis.log").read_text()
    return (*started, executable)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL (db 0) of a real redis-server started for the session on a free port, without persistence."""
    executable = shutil.which("redis-server")
    if executable is None:
        if os.environ.get("CLOUDLESS_SKIP_REDIS") == "1":
            pytest.skip("redis-server is not installed (CLOUDLESS_SKIP_REDIS=1)")
        pytest.fail(
            "redis-server is not on PATH: install it (Debian/Ubuntu: apt-get install redis-server; "
            "macOS: brew install redis), or set CLOUDLESS_SKIP_REDIS=1 to skip the Redis tests",
            pytrace=False,
        )
    folder = tmp_path_factory.mktemp("redis")
    for _attempt in range(3):
        started = _start_redis(executable, folder)
        if started is not None:
            break
    else:
        pytest.fail(f"redis-server exited at start three times:\n{(folder / 'redis.log').read_text()}")
    process, port = started
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(process)


# --- a small build the invoker, Step Functions and deploy tests share ---------------------------------

#: iterations of the `two_stages` build
TWO_STAGE_ITERATIONS = 3


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A 2-stage build of the MLP with replicas (2, 1) (workflow, front end's result alongside), for
    TWO_STAGE_ITERATIONS iterations. One thread: the tests run functions as threads of this process."""
    import torch

    from tests.runtime_cases import front_end, write_packages

    torch.set_num_threads(1)
    result = front_end()
    n = len(result.chain.blocks)
    build = tmp_path_factory.mktemp("two_stages") / "build"
    workflow = write_packages(
        result, build, [(0, 1, 2), (2, n - 1, 1)], micro_batch=8, global_batch=32, iterations=TWO_STAGE_ITERATIONS
    )
    return build, workflow, result
