"""The run contract between the compiler, the generated packages, the functions and the controller:
storage keys, environment and secret names, and the invocation payload.

Every key any party reads or writes is spelled here and nowhere else, so that the writer and the
reader cannot drift apart (a mismatch would show only inside a remote function, after the key
timeout). Standard library only: this module is vendored into every function package.

Keys of one region of one run live under its namespace `<run>/<region>` (the region alone when no
run name is given), in that region's storage; a region reads another's keys (synchronous SGD's
gradient sums, model averaging's models, ASGD-GA's global versions in the server region) under that
region's namespace, in that region's storage (`PEERS_ENV`), across the WAN. Training data lives
outside any run, under `data/<name>/<split>/`. The rest of the run
contract, what order the functions do an iteration's work in and which samples it reads, is in
`cloudless.ir.schedule`.

Integrity: every value in storage is `seal`ed (a header with the value's length and CRC-32); a reader
`unseal`s it and a mismatch is a `CorruptBlob` naming the key, never a silently different tensor.

Lifetimes. Each key has one owner, the function (replica) that writes it:
- the keys of iteration i (under `iteration_prefix`: activations, gradients, sync pieces, shared
  gradients, progress reports) live until their writer has checkpointed twice more; then it deletes
  them (`sweep_before`), so that a function falling back to its previous checkpoint still finds
  what its neighbours sent it after that checkpoint;
- a stage's checkpoints (`state_key`): its replica 0 keeps the newest two at multiples of
  `checkpoint_every`, and the one its invocation started from until two newer ones exist;
- completion markers, claims and stop decisions, per invocation: the controller deletes them when
  the range they belong to is done;
- the run's `alive_key` and `abort_key` live as long as the run's namespace;
- at the end of a run the controller deletes the run's namespaces unless asked to keep them; staged
  data is kept (it is shared by the runs on that storage and re-staged only when it changes).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import secrets
import sys
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

_V = TypeVar("_V")
#: what a round's key holds between regions: a region's `model`, the `result` its replica 0 got, or
#: the round's `members` (JSON {region: weight} of the models it averaged: what was applied)
RoundPart = Literal["model", "result", "members"]
#: ASGD-GA: a global version's `model`, its `owner` (who claimed the version) and its `push` (the
#: `PushRecord` of the update that made it)
GlobalPart = Literal["model", "owner", "push"]
#: synchronous cross-region SGD: a region's gradient sums of an iteration (`sums`, in its own storage,
#: read by every other region) and the reduced gradients its replica 0 got (`result`, for its replicas)
CrossPart = Literal["sums", "result"]

# -- environment and secrets ---------------------------------------------------------------------
#: where a function's storage is: a folder, s3://bucket/prefix or redis://host:port/db
STORAGE_ENV = "CLOUDLESS_STORAGE"
#: several regions: the other regions' storage, a JSON object {region name: location} (the same
#: location forms as STORAGE_ENV); a function reads and writes a peer's keys there, across the WAN.
#: Unset: every region's keys are in the function's own storage (one storage for all regions)
PEERS_ENV = "CLOUDLESS_PEERS"
#: another S3-protocol endpoint than AWS S3 (boto3's endpoint_url)
S3_ENDPOINT_ENV = "CLOUDLESS_S3_ENDPOINT"
#: set only by `cloudless-run --inject-storage-faults`: the transient faults every storage client of the
#: process meets (`runtimes/storage/transient.StorageFaults`, JSON)
STORAGE_FAULTS_ENV = "CLOUDLESS_STORAGE_FAULTS"
#: a Redis storage's password, for a redis:// URL without one (a command line is visible in `ps`): the
#: password itself, or the path of a file holding it (one line)
REDIS_PASSWORD_ENV = "CLOUDLESS_REDIS_PASSWORD"
REDIS_PASSWORD_FILE_ENV = "CLOUDLESS_REDIS_PASSWORD_FILE"
#: set only by `cloudless-run --emulate`: the function's link and CPU share, as Resources JSON
EMULATE_ENV = "CLOUDLESS_EMULATE"
#: the OpenFaaS secret holding storage credentials as NAME=value lines, and where OpenFaaS mounts it (a
#: rehearsal, `cloudless-run --invoker openfaas --rehearse`, mounts each function's secrets in a folder of its
#: own and names it in SECRETS_DIR_ENV: one machine runs many functions, none of them in a container)
STORAGE_SECRET = "cloudless-storage"
SECRETS_DIR_ENV = "CLOUDLESS_SECRETS_DIR"
SECRETS_DIR = os.environ.get(SECRETS_DIR_ENV) or "/var/openfaas/secrets"
#: OpenFaaS: the secret holding the deployment's invocation token (one line), the request header an
#: invocation carries it in (a function answers 401 without it), and the controller's variable for it
TOKEN_SECRET = "cloudless-token"
TOKEN_HEADER = "X-Cloudless-Token"
TOKEN_ENV = "CLOUDLESS_TOKEN"

#: how long a function waits for any one key unless the invocation says otherwise, seconds
DEFAULT_KEY_TIMEOUT_S = 600.0
#: several regions: how long cloudless-run lets a meet wait for another region's contribution before the
#: others go on without that region (it left the run), seconds; an invocation that gives no
#: `region_timeout` waits up to its key timeout and fails (a region started later is not a failed one)
DEFAULT_REGION_TIMEOUT_S = 120.0
#: the largest iteration, replica or attempt number a payload may carry (a signed 64-bit integer);
#: beyond it a key's name (`from<start>`, `a<attempt>`) outgrows what a storage holds
MAX_NUMBER = 2**63 - 1
#: a run name is one segment of every key of the run (`namespace`): a folder storage holds 255 bytes
MAX_RUN_BYTES = 128


# -- the invocation payload ----------------------------------------------------------------------
@dataclass(frozen=True)
class Invocation:
    """What one function invocation runs: iterations start..stop-1 of its stage as `replica`.

    On the wire `{"start": a, "stop": b, "replica": k}` (or `{"iteration": i, "replica": k}` for one
    iteration), with optional `run` (a name for the run's keys), `attempt` (a duplicate of the same
    attempt does nothing), `time_limit_s` (end early, where every function agrees, before this many
    seconds), `timeout` (how long to wait for any one key) and `iterations`, the region's iterations
    in this run (a learning-rate schedule stretches over them). Several regions: `rounds`, its
    inter-region syncs over its iterations (round k ends after `workflow.round_ends(iterations,
    rounds)[k]` iterations); default the workflow's. The
    coordinator's re-plan of a region (a capacity change, a region that left) adds: `since` and
    `first_round` (its iterations since..iterations-1 hold rounds first_round..rounds-1,
    `workflow.round_meets`), `replicas` (per stage, where capacity shrank), `weight` (its share of a
    round's samples) and `region_timeout` (how long a meet waits for another region before it goes on
    without it, `left_key`)."""

    start: int
    stop: int
    replica: int = 0
    run: str = ""
    attempt: int | None = None
    time_limit_s: float | None = None
    timeout: float | None = None
    iterations: int | None = None
    rounds: int | None = None
    since: int | None = None
    first_round: int | None = None
    replicas: tuple[int, ...] | None = None
    weight: float | None = None
    region_timeout: float | None = None

    def to_json(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"start": self.start, "stop": self.stop, "replica": self.replica}
        for name in (
            "run",
            "attempt",
            "time_limit_s",
            "timeout",
            "iterations",
            "rounds",
            "since",
            "first_round",
            "weight",
            "region_timeout",
        ):
            value = getattr(self, name)
            if value not in (None, ""):
                payload[name] = value
        if self.replicas is not None:
            payload["replicas"] = list(self.replicas)
        return payload

    @classmethod
    def from_json(cls, event: Any) -> Invocation:
        """The invocation of a payload; ValueError (a bad request) naming the field otherwise."""
        if not isinstance(event, Mapping):
            raise ValueError(
                f'expected a JSON object like {{"iteration": 0, "replica": 0}}, got {type(event).__name__}'
            )
        plan = event.get("plan", {})
        if not isinstance(plan, Mapping):
            raise ValueError(f"plan: expected a JSON object of the region's plan, got {type(plan).__name__}")
        # A state machine's execution carries the coordinator's plan of the region as one object (ASL
        # cannot spread one into the payload): its fields are the payload's.
        event = {**{k: v for k, v in event.items() if k != "plan"}, **plan}
        if "iteration" in event:
            start = event["iteration"]  # one iteration: its stop is checked as a range's is
            fields = {"start": start, "stop": start + 1 if isinstance(start, int) else start}
            fields["replica"] = event.get("replica", 0)
        else:
            fields = {"start": event.get("start"), "stop": event.get("stop"), "replica": event.get("replica", 0)}
        for name in ("attempt", "iterations", "rounds", "since", "first_round"):
            if event.get(name) is not None:
                fields[name] = event[name]
        for name, value in fields.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
            if not 0 <= value <= MAX_NUMBER:
                raise ValueError(f"{name}: expected an integer from 0 to 2**63 - 1, got {value}")
        run = event.get("run", "")
        check_run_name(run, "run")
        numbers: dict[str, float | None] = {}
        for name in ("time_limit_s", "timeout", "region_timeout"):
            value = event.get(name)
            if value is not None and (
                not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= sys.float_info.max
            ):
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
            numbers[name] = None if value is None else float(value)
        weight = event.get("weight")
        if weight is not None and (
            not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 < weight <= 1
        ):
            raise ValueError(f"weight: expected a share in (0, 1], got {weight!r}")
        replicas = event.get("replicas")
        if replicas is not None and (
            not isinstance(replicas, list)
            or not replicas
            or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024 for n in replicas)
        ):
            raise ValueError(f"replicas: expected a list of replica counts per stage (1 to 1024), got {replicas!r}")
        start = fields["start"]
        return cls(
            start=start,
            stop=fields.get("stop", start + 1),
            replica=fields["replica"],
            run=run,
            attempt=fields.get("attempt"),
            time_limit_s=numbers["time_limit_s"],
            timeout=numbers["timeout"],
            iterations=fields.get("iterations"),
            rounds=fields.get("rounds"),
            since=fields.get("since"),
            first_round=fields.get("first_round"),
            replicas=None if replicas is None else tuple(replicas),
            weight=None if weight is None else float(weight),
            region_timeout=numbers["region_timeout"],
        )


# -- what an invocation returns -------------------------------------------------------------------
#: done: it ran its range (or up to where the time limit stopped it); duplicate: another invocation
#: of the same attempt ran it; diverged: a loss or parameter was not finite (see `AbortRecord`);
#: aborted: it stopped because the region's run was aborted by another function; left: the other
#: regions went on without this one (it missed a meet by more than the region timeout, `left_key`);
#: failed: storage refused one of its writes (the reason names the key and the error)
InvocationStatus = Literal["done", "duplicate", "diverged", "aborted", "left", "failed"]


@dataclass(frozen=True)
class InvocationResult:
    """An invocation's result: what its handler returns and what its completion marker
    (`done_key`) holds. `losses` are the last stage's, per micro-batch of this replica, iterations
    `resumed`..`stop`-1; `spans` are [name, wall-clock start, end] of its work; `storage` counts its
    requests by kind."""

    status: InvocationStatus
    function: str
    replica: int
    start: int
    stage: int = 0
    resumed: int = 0
    stop: int = 0
    losses: tuple[float | None, ...] = ()
    seconds: float = 0.0
    storage: Mapping[str, int] = field(default_factory=dict)
    spans: tuple[tuple[str, float, float], ...] = ()
    duplicate: bool = False  # the marker of an earlier invocation, returned again
    reason: str = ""  # diverged, aborted or failed: one line saying why

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "function": self.function,
            "stage": self.stage,
            "replica": self.replica,
            "start": self.start,
            "resumed": self.resumed,
            "stop": self.stop,
            # JSON has no NaN: a non-finite loss is null (the run stops on it anyway)
            "losses": [x if x is not None and math.isfinite(x) else None for x in self.losses],
            "seconds": self.seconds,
            "storage": dict(sorted(self.storage.items())),
            "spans": [list(s) for s in self.spans],
            "duplicate": self.duplicate,
            "reason": self.reason,
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> InvocationResult:
        return cls(
            status=document["status"],
            function=str(document["function"]),
            replica=int(document["replica"]),
            start=int(document["start"]),
            stage=int(document.get("stage", 0)),
            resumed=int(document.get("resumed", document["start"])),
            stop=int(document.get("stop", document["start"])),
            losses=tuple(None if x is None else float(x) for x in document.get("losses", ())),
            seconds=float(document.get("seconds", 0.0)),
            storage={str(k): int(v) for k, v in document.get("storage", {}).items()},
            spans=tuple((str(n), float(a), float(b)) for n, a, b in document.get("spans", ())),
            duplicate=bool(document.get("duplicate", False)),
            reason=str(document.get("reason", "")),
        )

    @classmethod
    def decode(cls, data: bytes) -> InvocationResult:
        return cls.from_json(json.loads(data))


@dataclass(frozen=True)
class AbortRecord:
    """Why a region's run stopped, written once (create-if-absent) at `abort_key` by the function
    that found out; every function waiting on a key looks there now and then and gives up."""

    # diverged: a loss or parameter not finite; failed: the model's code raised (deterministic, so
    # no retry can help) or the controller gave up on an invocation after its retries; left: the other
    # regions went on without this one (`left_key`), so it stops; abandoned (never stored): a newer attempt
    # of the range runs (`attempt_key`), so this invocation stops
    reason: Literal["diverged", "failed", "left", "abandoned"]
    message: str  # one line: what, where (iteration, stage, function)
    iteration: int
    stage: int
    function: str

    def encode(self) -> bytes:
        return json.dumps(
            {k: getattr(self, k) for k in ("reason", "message", "iteration", "stage", "function")}, sort_keys=True
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> AbortRecord:
        d = json.loads(data)
        return cls(d["reason"], str(d["message"]), int(d["iteration"]), int(d["stage"]), str(d["function"]))


# -- progress reports ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MetricsReport:
    """What the last stage's replica writes at `metrics_key` after each iteration: its micro-batches'
    losses, in order (None for a loss that is not finite: JSON has no NaN), and the wall-clock time
    they were done."""

    losses: tuple[float | None, ...]
    time: float

    def encode(self) -> bytes:
        losses = [x if x is not None and math.isfinite(x) else None for x in self.losses]
        return json.dumps({"losses": losses, "time": self.time}, allow_nan=False).encode()

    @classmethod
    def decode(cls, data: bytes) -> MetricsReport:
        document = json.loads(data)
        return cls(tuple(None if x is None else float(x) for x in document["losses"]), float(document["time"]))


# -- integrity ------------------------------------------------------------------------------------
#: what every value in storage starts with: this tag, the value's length (8 bytes, little-endian)
#: and its CRC-32 (4 bytes). A CRC, not a cryptographic hash: it is there to catch damage (it finds
#: every flipped bit and burst up to 32 bits, and the length every truncation), not forgery, which
#: an unkeyed hash would not stop either; at about twice SHA-256's speed on the functions' CPU,
#: which every tensor sent through storage pays on both sides.
SEAL_TAG = b"CLD1"
SEAL_BYTES = len(SEAL_TAG) + 8 + 4


class CorruptBlob(Exception):
    """A value read from storage is not what was written (a flipped bit, truncated, not sealed).
    Not a ValueError: that is a bad request, and this is a failed run."""


def seal(data: bytes) -> bytes:
    """`data` as stored: the tag, its length and checksum, then the bytes."""
    return SEAL_TAG + len(data).to_bytes(8, "little") + zlib.crc32(data).to_bytes(4, "little") + data


def unseal(where: str, blob: bytes) -> bytes:
    """The value of a stored `blob`; CorruptBlob naming `where` (the key) if it does not check out."""
    if len(blob) < SEAL_BYTES or not blob.startswith(SEAL_TAG):
        raise CorruptBlob(f"{where}: corrupt: {len(blob)} bytes without Cloudless's integrity header")
    length = int.from_bytes(blob[4:12], "little")
    data = blob[SEAL_BYTES:]
    if len(data) != length:
        raise CorruptBlob(f"{where}: corrupt: {len(data)} bytes where {length} were written (truncated)")
    if zlib.crc32(data) != int.from_bytes(blob[12:SEAL_BYTES], "little"):
        raise CorruptBlob(f"{where}: corrupt: its {length} bytes do not match the checksum written with them")
    return data


# -- storage keys --------------------------------------------------------------------------------
def namespace(run: str, region: str) -> str:
    """The prefix of every key of one region's functions in one run."""
    return f"{run}/{region}" if run else region


def run_of(namespace_: str) -> str:
    """The run name of a namespace (empty when it has none)."""
    return namespace_.rsplit("/", 1)[0] if "/" in namespace_ else ""


def sweep_before(checkpoint: int, checkpoint_every: int) -> int:
    """Having written its checkpoint at `checkpoint` (a multiple of `checkpoint_every`), a function
    deletes the keys it wrote for iterations before this one, and its stage's checkpoint here.

    Two intervals back: every function of a region is within an iteration of the others (each
    waits for its neighbours' tensors), so none can still need them, even one that falls back from
    its newest checkpoint to the one before (a corrupt checkpoint) and replays from there."""
    return checkpoint - 2 * checkpoint_every


def iteration_prefix(ns: str, iteration: int) -> str:
    """Every key of one iteration's work (activations, gradients, sync pieces, reports) begins so."""
    return f"{ns}/it{iteration}/"


def iteration_of(ns: str, key: str) -> int | None:
    """The iteration whose work `key` (in namespace `ns`) is part of; None for keys that outlive
    iterations (checkpoints, markers)."""
    head = f"{ns}/it"
    if not key.startswith(head):
        return None
    number = key[len(head) :].split("/", 1)[0]
    return int(number) if number.isdigit() else None


def activation_key(ns: str, iteration: int, stage: int, micro_batch: int) -> str:
    """A stage's outputs for one micro-batch, read by the next stage's forward."""
    return f"{ns}/it{iteration}/act/s{stage}/mb{micro_batch}"


#: the folder of a function package that holds the model file and the modules beside it that it imports
#: (codegen writes it; a function imports the model file from it for the user's own code a run calls)
USER_FOLDER = "user"


def user_module_name(model_file: str) -> str:
    """The name the model file is imported under where stage code runs (the compiler's process, a
    function's), for `user_attribute` to find it."""
    stem = os.path.splitext(os.path.basename(model_file))[0]
    return "cloudless_user_file_" + "".join(c if c.isalnum() else "_" for c in stem)


def user_attribute(model_file: str, qualname: str, module: str | None = None) -> Any:
    """What generated stage code calls of the user's own code (a helper the tracer keeps as a call, such as
    a `torch.fx.wrap` function): of the model file itself, as the function or the compiler imported it (by
    `user_module_name`), or of `module`, one beside it (importable once the model file is)."""
    imported = sys.modules.get(user_module_name(model_file))
    if imported is None:
        raise ImportError(
            f"stage code calls {qualname} of {model_file}, which is not imported here: a function imports it "
            f"from its package's {USER_FOLDER}/ folder before its stage"
        )
    value: Any = imported if module is None else importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def target_key(ns: str, iteration: int, micro_batch: int) -> str:
    """A micro-batch's targets, written by the first stage (which read and collated them with its inputs)
    for the last stage's loss."""
    return f"{ns}/it{iteration}/target/mb{micro_batch}"


def gradient_key(ns: str, iteration: int, stage: int, micro_batch: int) -> str:
    """The gradients of a stage's inputs for one micro-batch, read by the previous stage's backward."""
    return f"{ns}/it{iteration}/grad/s{stage}/mb{micro_batch}"


def sync_key(ns: str, iteration: int, stage: int) -> str:
    """The prefix of a stage's scatter-reduce among its replicas (pieces below it: `scatter_piece_key`)."""
    return f"{ns}/it{iteration}/sync/s{stage}"


def scatter_piece_key(sync: str, chunk: int, sender: int, piece: int) -> str:
    """Piece `piece` of chunk `chunk` as replica `sender` holds it (the scatter phase)."""
    return f"{sync}/c{chunk}/from{sender}/p{piece}"


def reduced_piece_key(sync: str, chunk: int, piece: int) -> str:
    """Piece `piece` of chunk `chunk`, reduced by its owner (the gather phase)."""
    return f"{sync}/r{chunk}/p{piece}"


def grad_norm_key(ns: str, iteration: int, stage: int) -> str:
    """The sum of squares of a stage's gradients (its replicas' reduced sum; a tied parameter's at the
    first stage holding it), read by every stage to clip to the model's global norm."""
    return f"{ns}/it{iteration}/norm/s{stage}"


def shared_gradient_key(ns: str, iteration: int, stage: int) -> str:
    """A stage's gradients of the parameters it shares (tied) with other stages."""
    return f"{ns}/it{iteration}/shared/s{stage}"


def metrics_key(ns: str, iteration: int, replica: int) -> str:
    """The last stage's losses of one replica's micro-batches and when they were done (JSON)."""
    return f"{ns}/it{iteration}/metrics/r{replica}"


def state_key(ns: str, stage: int, iteration: int) -> str:
    """A stage's parameters, buffers and optimizer state before `iteration` (a checkpoint)."""
    return f"{ns}/state/s{stage}/it{iteration}"


def latest_state_key(ns: str, stage: int) -> str:
    """The stage's record of its checkpoints, written after each (JSON): `latest`, the newest one's
    iteration (where a retried invocation resumes, found with one read however long its range), and
    `between`, the checkpoints at an invocation's range end that are not multiples of checkpoint_every
    and not yet deleted (each is deleted once `sweep_before` passes it)."""
    return f"{ns}/state/s{stage}/latest"


def done_key(ns: str, function: str, replica: int, start: int) -> str:
    """An invocation's completion marker: its result, as JSON."""
    return f"{ns}/done/{function}/r{replica}/from{start}"


def claim_key(ns: str, function: str, replica: int, start: int, attempt: int) -> str:
    """Written create-if-absent by the one invocation of an attempt that runs (duplicates find it)."""
    return f"{ns}/claim/{function}/r{replica}/from{start}/a{attempt}"


def stop_key(ns: str, start: int) -> str:
    """Where the region's invocations that started at `start` all stop: the decision of the first
    stage's replica 0 (the leader: every other function is behind it), at its time limit or on the
    coordinator's request (`CUT_REQUEST`), which the key holds until the leader replaces it."""
    return f"{ns}/stop/from{start}"


#: a stop key's value written by the coordinator (a re-plan): "stop at a meet from this iteration on"
CUT_REQUEST = b"cut:"


def cut_request(value: bytes | None) -> int | None:
    """The iteration a stop key's value requests (the coordinator's), or None for a decision or nothing."""
    if value is None or not value.startswith(CUT_REQUEST):
        return None
    return int(value[len(CUT_REQUEST) :])


def new_run_id() -> str:
    """A fresh run's name when the user gives none: the time it started and 6 random hex digits
    (`run-20261126-161500-3fa2c1`), sortable, and unique among the runs of one bucket."""
    return f"{time.strftime('run-%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def check_run_name(run: Any, field: str) -> None:
    """ValueError naming `field` unless `run` can name a run: one segment of every key of the run."""
    # "." would alias the namespace without a run in a folder storage, "data" put the run's keys
    # (and its clean-up) under the training data's (`data_key`)
    if not isinstance(run, str) or "/" in run or ".." in run or run in (".", "data"):
        raise ValueError(f"{field}: expected a name without '/' or '..', other than '.' and 'data', got {run!r}")
    if not run.isprintable() or len(run.encode()) > MAX_RUN_BYTES:
        raise ValueError(f"{field}: expected at most {MAX_RUN_BYTES} bytes of printable characters, got {run!r}")


def alive_key(ns: str) -> str:
    """The controller's mark that a region's run exists, written when the run (or a resumed run)
    begins: if it goes, storage lost the run's keys (flushed, evicted, expired) and the run stops."""
    return f"{ns}/alive"


def attempt_key(ns: str) -> str:
    """The region's newest attempt (a decimal number), written by a driver that re-runs a whole range with
    a new attempt (a state machine's execution failed): invocations of an older attempt, still waiting
    for keys that the failed one will never write, find it and stop instead of waiting out the key timeout."""
    return f"{ns}/attempt"


def marker_prefixes(ns: str) -> tuple[str, ...]:
    """The prefixes of every range's markers (`done_key`, `claim_key`, `stop_key`) in a namespace."""
    return (f"{ns}/done/", f"{ns}/claim/", f"{ns}/stop/")


def abort_key(ns: str) -> str:
    """Where a region's run records why it stopped (`AbortRecord`)."""
    return f"{ns}/abort"


def round_key(ns: str, strategy: str, stage: int, round_index: int, part: RoundPart) -> str:
    """Between regions: a stage's `model` for a round (model averaging) or the round's `result`
    for the stage's other replicas."""
    return f"{ns}/{strategy}/s{stage}/round{round_index}/{part}"


#: what a region's contribution to a meet (`round_key` model, `cross_key` sums) is claimed with by
#: another region that stopped waiting for it: the region left the run at that meet
LEFT_MARK = b"cloudless:left"


def left_key(ns: str) -> str:
    """A region's departure: written (JSON {"by": region, "why": ...}) in the departed region's storage by the
    coordinator or by the first region that gave up waiting for it. From then on a meet that misses
    its contribution claims the contribution's key with `LEFT_MARK` at once instead of waiting."""
    return f"{ns}/left"


def global_key(ns: str, stage: int, version: int, part: GlobalPart) -> str:
    """ASGD-GA: version `version` of a stage's global model (`model`) and who wrote it (`owner`),
    in the server region's namespace."""
    return f"{ns}/global/s{stage}/v{version}/{part}"


def cross_key(ns: str, iteration: int, stage: int, part: CrossPart) -> str:
    """Synchronous cross-region SGD: a stage's gradient `sums` of one iteration in the region of
    namespace `ns` (every other region reads them), or the `result` of the cross-region reduce."""
    return f"{ns}/it{iteration}/cross/s{stage}/{part}"


@dataclass(frozen=True)
class PushRecord:
    """ASGD-GA: one push, written beside the global version it made (`global_key(..., "push")`).
    `base` is the version the region's round started from, `version` the one it wrote; `staleness`
    = version - 1 - base (other regions' pushes applied since its base); `scale` the factor its
    update was applied with; `rebased` whether staleness passed the bound (applied all the same)."""

    region: str
    round: int
    stage: int
    base: int
    version: int
    staleness: int
    scale: float
    rebased: bool

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> PushRecord:
        d = json.loads(data)
        return cls(
            str(d["region"]),
            int(d["round"]),
            int(d["stage"]),
            int(d["base"]),
            int(d["version"]),
            int(d["staleness"]),
            float(d["scale"]),
            bool(d["rebased"]),
        )


def global_owner(region: str, round_index: int) -> bytes:
    """ASGD-GA: what a version's `owner` key holds: the region and round whose update it is."""
    return f"{region}/round{round_index}".encode()


def data_key(name: str, split: str, part: str) -> str:
    """Training data: `meta` (JSON) and the shards (`shard_name`) of a split."""
    return f"data/{name}/{split}/{part}"


def members_key(name: str, split: str, location: str, version: str) -> str:
    """A tar shard's member table where it lies (JSON `[[file name, data offset, size], ...]`, written when
    the controller indexed it from its headers): a function then slices the shard's files from its bytes
    instead of parsing its headers again. Named by the shard's location and version: a shard written again
    has none until indexed again."""
    digest = hashlib.sha256(f"{location}\0{version}".encode()).hexdigest()[:32]
    return data_key(name, split, f"{MEMBERS_FOLDER}/{digest}")


def weights_key(ns: str, function: str) -> str:
    """A staged build's weights of one stage function (safetensors bytes): what `cloudless-run` staged
    from the model file's build_model() for the run, read by the function at iteration 0."""
    return f"{ns}/weights/{function}"


def shard_name(index: int) -> str:
    """The `part` of a split's shard `index` (`data_key`)."""
    return f"shard-{index:05d}"


#: the JSON beside a split's shards: samples, shard size, input and target leaf counts
DATA_META = "meta"
#: the folder of a split's member tables (`members_key`)
MEMBERS_FOLDER = "members"


# -- what a checkpoint (`state_key`) holds -------------------------------------------------------
#: a checkpoint's values are named `module/<state_dict name>`, `optimizer/<parameter>/<field>`, and
#: (ASGD-GA) `meta/base_version`: the global version the stage's model started its round from
MODULE_PREFIX = "module/"
OPTIMIZER_PREFIX = "optimizer/"
BASE_VERSION = "meta/base_version"
#: in a round's `result` (the other replicas' copy of what replica 0 got): the global version
ROUND_VERSION = "meta/version"
#: in a region's contribution to a meet (its round `model`, its `sums`): its weight, the share of the
#: samples it stands for; the meet takes the weighted mean over the contributions it has
ROUND_WEIGHT = "meta/weight"
#: an invocation's `storage` counts of requests to another region's storage, across the WAN, are
#: named `wan/<region>/<kind>` (kinds as for its own storage: gets, puts, deletes, bytes_in, bytes_out)
WAN_COUNT_PREFIX = "wan/"


def module_values(values: Mapping[str, _V]) -> dict[str, _V]:
    """A checkpoint's module state under the module's own names."""
    return {k.removeprefix(MODULE_PREFIX): v for k, v in values.items() if k.startswith(MODULE_PREFIX)}


#: training data where it lies in files of this suffix is Parquet, read by pyarrow: a first stage's package
#: installs it (the compiler), the functions and the controller read row groups with it (shards.py)
PARQUET_SUFFIX = ".parquet"
#: the module that reads Parquet, and so the one package a build with Parquet data in place installs for it
PARQUET_READER = "pyarrow"
