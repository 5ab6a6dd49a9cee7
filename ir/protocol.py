"""The run contract between the compiler, the generated packages, the functions and the controller:
storage keys, environment and secret names, and the invocation payload.

Every key any party reads or writes is spelled here and nowhere else, so that the writer and the
reader cannot drift apart (a mismatch would show only inside a remote function, after the key
timeout). Standard library only: this module is vendored into every function package.

Keys of one region of one run live under its namespace `<run>/<region>` (the region alone when no
run name is given); a region reads another's keys (model averaging, ASGD-GA) under that region's
namespace. Training data lives outside any run, under `data/<name>/<split>/`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

_V = TypeVar("_V")
#: what a round's key holds between regions: a region's `model`, or the `result` its replica 0 got
RoundPart = Literal["model", "result"]
#: ASGD-GA: a global version's `model`, and its `owner` (who claimed the version)
GlobalPart = Literal["model", "owner"]

# -- environment and secrets ---------------------------------------------------------------------
#: where a function's storage is: a folder, s3://bucket/prefix or redis://host:port/db
STORAGE_ENV = "CLOUDLESS_STORAGE"
#: another S3-protocol endpoint than AWS S3 (boto3's endpoint_url)
S3_ENDPOINT_ENV = "CLOUDLESS_S3_ENDPOINT"
#: set only by `cloudless-run --emulate`: the function's link and CPU share, as Resources JSON
EMULATE_ENV = "CLOUDLESS_EMULATE"
#: the OpenFaaS secret holding storage credentials as NAME=value lines, and where OpenFaaS mounts it
STORAGE_SECRET = "cloudless-storage"
SECRETS_DIR = "/var/openfaas/secrets"

#: how long a function waits for any one key unless the invocation says otherwise, seconds
DEFAULT_KEY_TIMEOUT_S = 600.0


# -- the invocation payload ----------------------------------------------------------------------
@dataclass(frozen=True)
class Invocation:
    """What one function invocation runs: iterations start..stop-1 of its stage as `replica`.

    On the wire `{"start": a, "stop": b, "replica": k}` (or `{"iteration": i, "replica": k}` for one
    iteration), with optional `run` (a name for the run's keys), `attempt` (a duplicate of the same
    attempt does nothing), `time_limit_s` (end early, where every function agrees, before this many
    seconds) and `timeout` (how long to wait for any one key)."""

    start: int
    stop: int
    replica: int = 0
    run: str = ""
    attempt: int | None = None
    time_limit_s: float | None = None
    timeout: float | None = None

    def to_json(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"start": self.start, "stop": self.stop, "replica": self.replica}
        for name in ("run", "attempt", "time_limit_s", "timeout"):
            value = getattr(self, name)
            if value not in (None, ""):
                payload[name] = value
        return payload

    @classmethod
    def from_json(cls, event: Any) -> Invocation:
        """The invocation of a payload; ValueError (a bad request) naming the field otherwise."""
        if not isinstance(event, Mapping):
            raise ValueError(
                f'expected a JSON object like {{"iteration": 0, "replica": 0}}, got {type(event).__name__}'
            )
        if "iteration" in event:
            fields = {"start": event["iteration"], "replica": event.get("replica", 0)}
        else:
            fields = {"start": event.get("start"), "stop": event.get("stop"), "replica": event.get("replica", 0)}
        if event.get("attempt") is not None:
            fields["attempt"] = event["attempt"]
        for name, value in fields.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
        run = event.get("run", "")
        if not isinstance(run, str) or "/" in run or ".." in run:
            raise ValueError(f"run: expected a name without '/', got {run!r}")
        numbers: dict[str, float | None] = {}
        for name in ("time_limit_s", "timeout"):
            value = event.get(name)
            if value is not None and (
                not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0
            ):
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
            numbers[name] = None if value is None else float(value)
        start = fields["start"]
        return cls(
            start=start,
            stop=fields.get("stop", start + 1),
            replica=fields["replica"],
            run=run,
            attempt=fields.get("attempt"),
            time_limit_s=numbers["time_limit_s"],
            timeout=numbers["timeout"],
        )


# -- progress reports ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MetricsReport:
    """What the last stage's replica writes at `metrics_key` after each iteration: its micro-batches'
    losses, in order, and the wall-clock time they were done."""

    losses: tuple[float, ...]
    time: float

    def encode(self) -> bytes:
        return json.dumps({"losses": list(self.losses), "time": self.time}).encode()

    @classmethod
    def decode(cls, data: bytes) -> MetricsReport:
        document = json.loads(data)
        return cls(tuple(float(x) for x in document["losses"]), float(document["time"]))


# -- storage keys --------------------------------------------------------------------------------
def namespace(run: str, region: str) -> str:
    """The prefix of every key of one region's functions in one run."""
    return f"{run}/{region}" if run else region


def run_of(namespace_: str) -> str:
    """The run name of a namespace (empty when it has none)."""
    return namespace_.rsplit("/", 1)[0] if "/" in namespace_ else ""


def activation_key(ns: str, iteration: int, stage: int, micro_batch: int) -> str:
    """A stage's outputs for one micro-batch, read by the next stage's forward."""
    return f"{ns}/it{iteration}/act/s{stage}/mb{micro_batch}"


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


def shared_gradient_key(ns: str, iteration: int, stage: int) -> str:
    """A stage's gradients of the parameters it shares (tied) with other stages."""
    return f"{ns}/it{iteration}/shared/s{stage}"


def metrics_key(ns: str, iteration: int, replica: int) -> str:
    """The last stage's losses of one replica's micro-batches and when they were done (JSON)."""
    return f"{ns}/it{iteration}/metrics/r{replica}"


def state_key(ns: str, stage: int, iteration: int) -> str:
    """A stage's parameters, buffers and optimizer state before `iteration` (a checkpoint)."""
    return f"{ns}/state/s{stage}/it{iteration}"


def done_key(ns: str, function: str, replica: int, start: int) -> str:
    """An invocation's completion marker: its result, as JSON."""
    return f"{ns}/done/{function}/r{replica}/from{start}"


def claim_key(ns: str, function: str, replica: int, start: int, attempt: int) -> str:
    """Written create-if-absent by the one invocation of an attempt that runs (duplicates find it)."""
    return f"{ns}/claim/{function}/r{replica}/from{start}/a{attempt}"


def stop_key(ns: str, start: int) -> str:
    """Where the region's invocations that started at `start` all stop (the time limit's decision)."""
    return f"{ns}/stop/from{start}"


def round_key(ns: str, strategy: str, stage: int, round_index: int, part: RoundPart) -> str:
    """Between regions: a stage's `model` for a round (model averaging) or the round's `result`
    for the stage's other replicas."""
    return f"{ns}/{strategy}/s{stage}/round{round_index}/{part}"


def global_key(ns: str, stage: int, version: int, part: GlobalPart) -> str:
    """ASGD-GA: version `version` of a stage's global model (`model`) and who wrote it (`owner`),
    in the server region's namespace."""
    return f"{ns}/global/s{stage}/v{version}/{part}"


def global_owner(region: str, round_index: int) -> bytes:
    """ASGD-GA: what a version's `owner` key holds: the region and round whose update it is."""
    return f"{region}/round{round_index}".encode()


def data_key(name: str, split: str, part: str) -> str:
    """Training data: `meta` (JSON) and the shards (`shard_name`) of a split."""
    return f"data/{name}/{split}/{part}"


def shard_name(index: int) -> str:
    """The `part` of a split's shard `index` (`data_key`)."""
    return f"shard-{index:05d}"


#: the JSON beside a split's shards: samples, shard size, input and target leaf counts
DATA_META = "meta"


# -- what a checkpoint (`state_key`) holds -------------------------------------------------------
#: a checkpoint's values are named `module/<state_dict name>`, `optimizer/<parameter>/<field>`, and
#: (ASGD-GA) `meta/base_version`: the global version the stage's model started its round from
MODULE_PREFIX = "module/"
OPTIMIZER_PREFIX = "optimizer/"
BASE_VERSION = "meta/base_version"
#: in a round's `result` (the other replicas' copy of what replica 0 got): the global version
ROUND_VERSION = "meta/version"


def module_values(values: Mapping[str, _V]) -> dict[str, _V]:
    """A checkpoint's module state under the module's own names."""
    return {k.removeprefix(MODULE_PREFIX): v for k, v in values.items() if k.startswith(MODULE_PREFIX)}

