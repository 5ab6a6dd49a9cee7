"""The run contract (`cloudless.ir.protocol`): spelled once, and both sides of it agree.

- No storage key, environment or secret name is spelled outside the protocol module (a scan of the
  source of runtimes/, compiler/ and codegen/).
- A real run (a 3-stage build of a model with tied weights, replicas 2 + 2 + 1, driven by the
  controller through the handlers' entry point, with a time limit so that invocations end early)
  writes only keys of the protocol's shapes, and the controller finds the workers' completion
  markers and progress reports where the protocol says.
- The worker runs, per function and iteration, exactly the workflow's steps for that function, in
  an order consistent with their `depends_on` (the steps describe the worker's order; nothing
  executes them), including the tied parameters' partner stages.
- `Invocation.from_json` rejects what a function must not run, naming the field.
"""

from __future__ import annotations

import ast
import json
import math
import re
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from cloudless.ir import protocol
from cloudless.ir.protocol import Invocation, InvocationResult
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.control.controller import Controller
from cloudless.runtimes.control.invokers import Handle, InvocationFailed, Invoker
from cloudless.runtimes.control.invokers import Invocation as Call
from cloudless.runtimes.control.run_state import RegionRun, RunSettings
from cloudless.runtimes.function.worker import handle_request
from cloudless.runtimes.storage.channels import DirectoryChannel
from tests.runtime_cases import check_step_order, front_end, write_packages, write_training_data

ROOT = Path(__file__).resolve().parents[1]

# --- (a) nothing of the contract is spelled twice ------------------------------------------------

#: fragments of the protocol's keys and names, in a string's text with every f-string field as "{}"
FRAGMENTS = [
    r"(^|/)it\{\}",
    # (a key's fixed parts are followed by a field: "data/inputs" naming a YAML key is no storage key)
    r"/(act|grad|sync|shared|metrics|state|done|claim|stop|global|abort)/[a-z]*\{\}",
    r"/(from|round|mb|p|c|r|v)\{\}",
    r"^data/\{\}",
    r"shard-",
    r"CLOUDLESS_",
    re.escape(protocol.STORAGE_SECRET),
    re.escape(protocol.SECRETS_DIR),
    r"^(module|optimizer|meta)/\{\}",
    r"^meta/(base_)?version$",
]
SCANNED = ("runtimes", "compiler", "codegen")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (documentation may name keys)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def spelled_keys(source: str, filename: str) -> list[str]:
    """`file:line: text` of every string (f-string fields as {}) that spells a part of the contract."""
    tree = ast.parse(source, filename)
    skip = _docstrings(tree)
    inside_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in skip or id(node) in inside_fstrings:
                continue
            text = node.value
        else:
            continue
        if any(re.search(fragment, text) for fragment in FRAGMENTS):
            found.append(f"{filename}:{node.lineno}: {text!r}")
    return found


def test_the_scan_finds_keys_spelled_by_hand() -> None:
    """The ways the runtime used to spell keys are all caught."""
    source = """
def f(ns, i, s, m, run, region, name, replica, start, stage, version, index):
    a = "/".join([ns, f"it{i}", "act", f"s{s}", f"mb{m}"])
    b = f"{ns}/state/s{s}/it{i}"
    c = f"{ns}/done/{name}/r{replica}/from{start}"
    d = f"{run}/{region}/global/s{stage}/v{version}/owner"
    e = f"data/{region}/train/shard-{index:05d}"
    g = os.environ.get("CLOUDLESS_STORAGE")
    h = "cloudless-storage"
    k = f"module/{name}"
    return f"{ns}/it{i}/sync/s{s}" + f"/c{s}/from{replica}/p{m}"
"""
    lines = {int(hit.split(":")[1]) for hit in spelled_keys(source, "example.py")}
    assert lines == set(range(3, 12))


def test_no_key_or_name_of_the_contract_is_spelled_outside_the_protocol() -> None:
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += spelled_keys(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "spell these through cloudless.ir.protocol:\n" + "\n".join(found)


# --- (c) the invocation payload ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "field"),
    [
        ({"iteration": 0, "timeout": math.nan}, "timeout"),
        ({"iteration": 0, "timeout": math.inf}, "timeout"),
        ({"iteration": 0, "timeout": -1.0}, "timeout"),
        ({"iteration": 0, "timeout": 0}, "timeout"),
        ({"iteration": 0, "timeout": True}, "timeout"),
        ({"iteration": 0, "timeout": "60"}, "timeout"),
        ({"iteration": 0, "time_limit_s": math.inf}, "time_limit_s"),
        ({"iteration": 0, "time_limit_s": -math.inf}, "time_limit_s"),
        ({"iteration": 0, "time_limit_s": math.nan}, "time_limit_s"),
        ({"iteration": True}, "start"),
        ({"iteration": 1.0}, "start"),
        ({"start": 0}, "stop"),
        ({"start": 0, "stop": False}, "stop"),
        ({"iteration": 0, "replica": True}, "replica"),
        ({"iteration": 0, "attempt": False}, "attempt"),
        ({"iteration": 0, "run": "a/b"}, "run"),
        ({"iteration": 0, "run": ".."}, "run"),
        ({"iteration": 0, "run": 7}, "run"),
    ],
)
def test_a_bad_invocation_is_rejected_naming_its_field(event: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        Invocation.from_json(event)
    # The functions' entry point parses it the same way, before it looks for storage.
    with pytest.raises(ValueError, match=f"^{field}: "):
        handle_request(Path("no-package"), event, storage="unused")


def test_an_invocation_reads_back_what_it_writes() -> None:
    with pytest.raises(ValueError, match="expected a JSON object"):
        Invocation.from_json([0])
    call = Invocation(3, 7, replica=1, run="r", attempt=0, time_limit_s=5.0, timeout=60.0)
    assert Invocation.from_json(json.loads(json.dumps(call.to_json()))) == call
    assert Invocation.from_json({"iteration": 4}) == Invocation(4, 5)


# --- (b) both sides agree, on a real run ---------------------------------------------------------

#: a small model whose embedding and output layer share one weight, so two stages hold it
TIED_MODEL = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

TRAINING = {"global_batch_size": 16, "micro_batch_sizes": [4], "iterations": 6, "learning_rate": 0.1}


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens).mean(1)
        return self.head(torch.relu(self.out(torch.relu(self.mid(x)))))


def build_model():
    torch.manual_seed(0)
    return Tied()


def _data(n):
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 20, (n, 4), generator=g), torch.randint(0, 20, (n,), generator=g)


def example_inputs(batch_size):
    return (_data(batch_size)[0],)


def example_targets(batch_size):
    return _data(batch_size)[1]


def load_shard(region, split):
    return TensorDataset(*_data(96 if split == "train" else 32))
"""
RUN = "proto"
ITERATIONS = 6  # checkpoint_every is then 2


class _Thread(Handle):
    """An invocation run by `handle_request` in a thread, done when its marker is in storage (as the
    asynchronous invokers see it): the marker's key is the protocol's, not the worker's return."""

    def __init__(self, channel: DirectoryChannel, key: str, thread: threading.Thread, errors: list[BaseException]):
        self.channel, self.key, self.thread, self.errors = channel, key, thread, errors

    def poll(self) -> InvocationResult | None:
        if self.errors:
            raise InvocationFailed(repr(self.errors[0]))
        data = self.channel.try_get(self.key)
        if data is None and not self.thread.is_alive():
            raise InvocationFailed(f"returned without a completion marker at {self.key}")
        return None if data is None else InvocationResult.decode(data)


class ThreadInvoker(Invoker):
    """Each invocation goes through the functions' entry point (the JSON payload, as on the wire)."""

    name = "threads"

    def __init__(self, build: Path, storage: Path, region: str) -> None:
        self.build, self.storage, self.region = build, storage, region
        self.channel = DirectoryChannel(storage)

    def start(self, invocation: Call) -> Handle:
        event = json.loads(json.dumps(invocation.event.to_json()))
        errors: list[BaseException] = []

        def work() -> None:
            try:
                handle_request(self.build / invocation.function.package, event, str(self.storage))
            except BaseException as exc:  # noqa: BLE001 - reported by the handle's poll
                errors.append(exc)

        thread = threading.Thread(target=work)
        thread.start()
        namespace = protocol.namespace(event["run"], self.region)
        key = protocol.done_key(namespace, invocation.function.name, invocation.replica, invocation.event.start)
        return _Thread(self.channel, key, thread, errors)


class TiedRun(NamedTuple):
    workflow: Workflow
    storage: Path
    record: RegionRun
    controller: Controller
    #: every key any party wrote during the run (data staging included), and when it was written
    written: dict[str, float]


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory: pytest.TempPathFactory) -> TiedRun:
    written: dict[str, float] = {}
    write, create = DirectoryChannel._write, DirectoryChannel._create

    def recorded_write(self: DirectoryChannel, key: str, blob: bytes) -> None:
        write(self, key, blob)
        written[key] = time.time()

    def recorded_create(self: DirectoryChannel, key: str, blob: bytes) -> bool:
        created = create(self, key, blob)
        written.setdefault(key, time.time())
        return created

    with pytest.MonkeyPatch.context() as patch:  # the workers run in this process (threads)
        patch.setattr(DirectoryChannel, "_write", recorded_write)
        patch.setattr(DirectoryChannel, "_create", recorded_create)
        return _tied_run(tmp_path_factory, written)


def _tied_run(tmp_path_factory: pytest.TempPathFactory, written: dict[str, float]) -> TiedRun:
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("protocol")
    (folder / "tied.py").write_text(TIED_MODEL)
    result = front_end(folder / "tied.py", batch_size=4)
    n = len(result.chain.blocks)
    stages = [(0, 0, 2), (1, n - 2, 2), (n - 1, n - 1, 1)]
    workflow = write_packages(result, folder / "build", stages, micro_batch=4, global_batch=16, iterations=ITERATIONS)
    functions = workflow.regions[0].functions
    assert functions[0].shared_parameters == functions[2].shared_parameters == ("embed.weight",)
    assert workflow.run.checkpoint_every == 2
    region = workflow.regions[0].name
    storage = folder / "storage"
    write_training_data(result, DirectoryChannel(storage), region)
    # A time limit far below an iteration's time: every range ends early, at a stop key.
    settings = RunSettings(iterations=ITERATIONS, run_id=RUN, time_limit_s=0.001, key_timeout_s=60.0, retries=0)
    invoker = ThreadInvoker(folder / "build", storage, region)
    controller = Controller(workflow, DirectoryChannel(storage), invoker, settings)
    records = controller.run()
    return TiedRun(workflow, storage, records[region], controller, written)


def key_shapes() -> dict[str, re.Pattern[str]]:
    """Each run key function of the protocol, called with patterns for its arguments."""
    ns, n, name = r"[^/]+/[^/]+", r"\d+", r"[^/]+"
    sync = protocol.sync_key(ns, n, n)
    shapes: dict[str, str] = {
        "activation_key": protocol.activation_key(ns, n, n, n),
        "gradient_key": protocol.gradient_key(ns, n, n, n),
        "target_key": protocol.target_key(ns, n, n),
        "scatter_piece_key": protocol.scatter_piece_key(sync, n, n, n),
        "reduced_piece_key": protocol.reduced_piece_key(sync, n, n),
        "shared_gradient_key": protocol.shared_gradient_key(ns, n, n),
        "metrics_key": protocol.metrics_key(ns, n, n),
        "state_key": protocol.state_key(ns, n, n),
        "latest_state_key": protocol.latest_state_key(ns, n),
        "done_key": protocol.done_key(ns, name, n, n),
        "claim_key": protocol.claim_key(ns, name, n, n, n),
        "stop_key": protocol.stop_key(ns, n),
        "abort_key": protocol.abort_key(ns),
        "alive_key": protocol.alive_key(ns),
        "round_key": protocol.round_key(ns, name, n, n, "(model|result)"),
        "global_key": protocol.global_key(ns, n, n, "(model|owner)"),
    }
    return {kind: re.compile(shape) for kind, shape in shapes.items()}


def test_every_key_in_storage_has_a_shape_of_the_protocol(tied_run: TiedRun) -> None:
    workflow, storage = tied_run.workflow, tied_run.storage
    region = workflow.regions[0].name
    keys = set(tied_run.written)
    # Outside the run's namespace: exactly the meta and shards of each split, as the protocol names them.
    data = {key for key in keys if not key.startswith(protocol.namespace(RUN, region) + "/")}
    wanted = set()
    channel = DirectoryChannel(storage)
    for split in ("train", "test"):
        meta = json.loads(channel.get(protocol.data_key(region, split, protocol.DATA_META), timeout=1))
        wanted.add(protocol.data_key(region, split, protocol.DATA_META))
        shards = math.ceil(meta["samples"] / meta["shard_samples"])
        wanted |= {protocol.data_key(region, split, protocol.shard_name(i)) for i in range(shards)}
    assert data == wanted
    shapes = key_shapes()
    used: dict[str, int] = {}
    for key in sorted(keys - data):
        kinds = [kind for kind, shape in shapes.items() if shape.fullmatch(key)]
        assert len(kinds) == 1, f"{key}: matches {kinds or 'no key shape of cloudless.ir.protocol'}"
        used[kinds[0]] = used.get(kinds[0], 0) + 1
    # The run used every key of one region (not the inter-region ones, nor the abort record).
    assert set(used) == set(shapes) - {"round_key", "global_key", "abort_key"}, used


def test_storage_keeps_only_what_can_still_be_needed(tied_run: TiedRun, tmp_path: Path) -> None:
    """The keys' lifetimes (the protocol's docstring): after the run, the markers of finished ranges
    are gone; of the iterations' keys, only those after `sweep_before` the last checkpoint; of the
    checkpoints, the last two. The clean-up then leaves the staged data alone."""
    workflow, storage = tied_run.workflow, tied_run.storage
    region = workflow.regions[0]
    ns = protocol.namespace(RUN, region.name)
    every = workflow.run.checkpoint_every
    kept = {p.relative_to(storage).as_posix() for p in (storage / ns).rglob("*") if p.is_file()}
    shapes = key_shapes()
    for key in kept:
        kind = next(kind for kind, shape in shapes.items() if shape.fullmatch(key))
        assert kind not in ("done_key", "claim_key", "stop_key"), key
        iteration = protocol.iteration_of(ns, key)
        if iteration is not None:
            assert iteration >= protocol.sweep_before(ITERATIONS, every), key
    states = {key for key in kept if shapes["state_key"].fullmatch(key)}
    last_two = {protocol.state_key(ns, f.stage, i) for f in region.functions for i in (ITERATIONS - every, ITERATIONS)}
    # ... and at most the one each stage's last invocation started from (not a multiple of `every`)
    assert last_two <= states and len(states - last_two) <= len(region.functions)
    assert all(int(key.rsplit("it", 1)[1]) > ITERATIONS - every for key in states - last_two)
    written_iterations = {protocol.iteration_of(ns, key) for key in tied_run.written} - {None}
    assert written_iterations == set(range(ITERATIONS))  # (so the sweep had something to delete)
    assert all(not key.endswith("/") for key in kept)
    # The clean-up (on a copy: the other tests read the run's storage) leaves only the staged data.
    copy = tmp_path / "storage"
    shutil.copytree(storage, copy)
    data = sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_file() and not p.is_relative_to(copy / RUN))
    used = tied_run.controller
    assert Controller(workflow, DirectoryChannel(copy), used.invoker, used.settings).clean_up() == len(kept)
    assert sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_file()) == data


def test_the_controller_finds_the_workers_markers_and_reports(tied_run: TiedRun) -> None:
    workflow, storage, record = tied_run.workflow, tied_run.storage, tied_run.record
    # Every invocation was seen done through its marker at protocol.done_key (the invoker above),
    # and several ranges were needed (each ended at the stop key the workers agreed on).
    assert record.retries == 0 and all(i["status"] == "done" for i in record.invocations)
    starts = sorted({r.start for r in record.results})
    assert len(starts) > 1 and starts[0] == 0
    # Progress: every iteration's report, read at protocol.metrics_key, holds the last stage's losses.
    assert [p.iteration for p in record.progress] == list(range(ITERATIONS))
    assert all(0 < p.loss < 10 for p in record.progress)
    assert record.lost_reports == 0
    region = workflow.regions[0]
    ns = protocol.namespace(RUN, region.name)
    last = region.functions[-1]
    channel = DirectoryChannel(storage)
    for p in record.progress:
        if p.iteration < protocol.sweep_before(ITERATIONS, workflow.run.checkpoint_every):
            continue  # swept by its writer since
        key = protocol.metrics_key(ns, p.iteration, 0)
        report = protocol.MetricsReport.decode(channel.get(key, timeout=1))
        assert len(report.losses) == workflow.run.micro_batches // last.replicas
        assert p.loss == pytest.approx(sum(report.losses) / len(report.losses))
    # The controller's final model is at the protocol's state keys.
    for function in region.functions:
        assert channel.exists(protocol.state_key(ns, function.stage, ITERATIONS))


# --- (4) the steps describe the worker's order ---------------------------------------------------


def test_the_worker_runs_each_functions_steps_in_the_dags_order(tied_run: TiedRun) -> None:
    workflow, record = tied_run.workflow, tied_run.record
    region = workflow.regions[0]
    ns = protocol.namespace(RUN, region.name)
    spans: dict[tuple[str, int, int], list[tuple[str, float, float]]] = {}  # (function, replica, i)
    ran: dict[str, set[str]] = {}
    for result in record.results:
        for offset, iteration in enumerate(check_step_order(workflow, region.name, result)):
            spans[(result.function, result.replica, result.resumed + offset)] = iteration
            ran.setdefault(result.function, set()).update(kind for kind, _, _ in iteration)
    # The check fails on steps the worker does not follow: an order reversed, a step not listed.
    result = next(r for r in record.results if r.function == region.functions[0].name and r.replica == 0)
    steps = list(workflow.steps)
    update = next(i for i, s in enumerate(steps) if s.function == result.function and s.kind == "optimizer-step")
    checkpoint = next(s for s in steps if s.function == result.function and s.kind == "checkpoint")
    reversed_ = [*steps[:update], replace(steps[update], depends_on=(checkpoint.id,)), *steps[update + 1 :]]
    for wrong in (reversed_, [s for s in steps if s.id != checkpoint.id]):
        with pytest.raises(AssertionError):
            check_step_order(replace(workflow, steps=tuple(wrong)), region.name, result)
    # Over the run, each function ran exactly the kinds of steps listed for it.
    for function in region.functions:
        listed = {s.kind for s in workflow.steps if s.function == function.name}
        assert ran[function.name] == listed, function.name
    # Across functions: an optimizer step comes after every step of another function it depends on
    # (a tied parameter's partner stages): after their computes, and after every piece of their
    # scatter-reduce is in storage (when each of its keys was written).
    checked = 0
    by_id = {s.id: s for s in workflow.steps}
    for step in workflow.steps:
        if step.kind != "optimizer-step":
            continue
        mine = region.function(step.function)
        for dependency in (by_id[d] for d in step.depends_on):
            if dependency.function == mine.name:
                continue
            partner = region.function(dependency.function)
            for i in range(ITERATIONS):
                for replica in range(mine.replicas):
                    began = next(b for k, b, _ in spans[(mine.name, replica, i)] if k == "optimizer-step")
                    if dependency.kind == "compute":
                        ends = [
                            e
                            for r in range(partner.replicas)
                            for k, _, e in spans[(partner.name, r, i)]
                            if k == "compute"
                        ]
                    else:
                        assert dependency.kind == "scatter-reduce"
                        sync = protocol.sync_key(ns, i, partner.stage)
                        pieces = {k: t for k, t in tied_run.written.items() if k.startswith(sync + "/")}
                        assert protocol.reduced_piece_key(sync, 0, 0) in pieces
                        ends = list(pieces.values())
                    assert ends and max(ends) <= began + 1e-6, f"{step.id} iteration {i}: before {dependency.id}"
                    checked += 1
    assert checked >= 2 * ITERATIONS  # both tied stages, each against the other
