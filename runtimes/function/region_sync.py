"""The sync between regions: synchronous SGD's cross-region reduce of every iteration's gradients,
model averaging and ASGD-GA at the ends of rounds, and a meet that goes on without a region that
missed it by the region timeout (`protocol.LEFT_MARK`).

`RegionSync` owns what only the sync between regions uses: the strategy, every region's weight (and
this invocation's), the rounds' meets, the region timeout, the regions seen leaving, ASGD-GA's server
and the base version this region's round started from (which a checkpoint holds: `checkpointed`,
`restore`), and the WAN channel to each other region's storage.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import torch

from ...ir import protocol
from ...ir.protocol import LEFT_MARK, ROUND_WEIGHT, AbortRecord, GlobalPart, PushRecord
from ...ir.workflow import round_meets
from ..storage.channels import Channel, KeyTimeout
from ..storage.emulation import EmulatedChannel, wan_channel, wan_link
from ..storage.polling import Backoff
from ..storage.tensors import pack, unpack
from .failures import RegionLeft
from .stage_context import InvocationState, StageContext


class RegionSync:
    """The stage's sync with its counterparts in the other regions."""

    def __init__(
        self,
        context: StageContext,
        invocation: InvocationState,
        *,
        storage: Channel,
        peer_storage: dict[str, Channel],
        emulate_wan: bool,
    ) -> None:
        """`peer_storage`: each other region's storage (one not named: it is `storage`, the function's
        own, which then holds the peer's keys too); `emulate_wan`: throttle each pair's WAN link."""
        self.context, self.invocation = context, invocation
        # the facts this part uses most, by their short names (the context's, never reassigned)
        self.region, self.stage, self.channel = context.region, context.stage, context.channel
        workflow = context.workflow
        self.sync = workflow.sync
        # Several regions: this stage meets its counterparts at the ends of the rounds (`meets`).
        self.inter_region = self.sync.inter_region if len(workflow.regions) > 1 else None
        self.meets: dict[int, int] = {}  # iterations done -> the round that ends there
        # Every region and its weight, in region order: its share of a round's samples (model
        # averaging, ASGD-GA) or of an iteration's (sync); equal shares where the plan gives none
        self.peers = [(r.name, float(r.weight or 1.0 / len(workflow.regions))) for r in workflow.regions]
        self.weight = dict(self.peers)[self.region]  # this invocation's (the coordinator may re-plan it)
        # how long a meet waits for another region before going on without it; None (an invocation that
        # does not say, e.g. a deployed region's state machine): until the key timeout, then fail
        self.region_timeout: float | None = None
        self.departed: set[str] = set()  # regions this worker has seen leave (they contribute no more)
        self.server = self.sync.server
        # Other regions' storage, across the WAN (unnamed: the peer's keys are in this storage)
        others = {r.name for r in workflow.regions} | ({self.server} if self.server else set())
        self.wan: dict[str, EmulatedChannel] = {
            name: wan_channel(peer_storage.get(name, storage), wan_link(workflow.wan, self.region, name), emulate_wan)
            for name in sorted(others - {self.region})
        }
        self.base_version = 0  # ASGD-GA: the global version this region's model started its round from

    # -- the worker's calls ----------------------------------------------------------------------
    def begin(
        self,
        iterations: int | None,
        rounds: int | None,
        since: int,
        first_round: int,
        *,
        weight: float | None,
        region_timeout: float | None,
    ) -> None:
        """An invocation's plan of the region (`protocol.Invocation`): its weight (else the plan's), its
        region timeout, and where its rounds end. A ValueError if the rounds do not fit."""
        self.weight = weight if weight is not None else dict(self.peers)[self.region]
        self.region_timeout = region_timeout
        self.meets = self._meets(iterations, rounds, since, first_round)

    def new_run(self) -> None:
        """Another run's invocation: the regions seen leaving were that run's."""
        self.departed.clear()

    def round_ending(self, iterations_done: int) -> int | None:
        """The round that ends once `iterations_done` iterations are done, if one does."""
        return self.meets.get(iterations_done)

    def checkpointed(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of region sync: under ASGD-GA, the base version."""
        if self.inter_region == "asgd-ga":
            return {protocol.BASE_VERSION: torch.tensor(self.base_version)}
        return {}

    def restore(self, values: Mapping[str, torch.Tensor]) -> None:
        """Take the base version from a checkpoint's `values` (0 without one: the run's start)."""
        self.base_version = int(values[protocol.BASE_VERSION]) if protocol.BASE_VERSION in values else 0

    def wan_counts(self) -> dict[str, int]:
        """Requests and bytes so far to each other region's storage (`wan/<region>/<kind>`)."""
        counts: dict[str, int] = {}
        for name, peer in self.wan.items():
            counts.update({f"{protocol.WAN_COUNT_PREFIX}{name}/{k}": v for k, v in peer.counts.items()})
        return counts

    def _initial_weights(self) -> dict[str, torch.Tensor]:
        return self.context.initial_weights(self.invocation.namespace, self.invocation.key_timeout)

    def _meets(self, iterations: int | None, rounds: int | None, since: int, first_round: int) -> dict[int, int]:
        """Model averaging and ASGD-GA: after how many iterations each round ends -> its index, from
        the region's iterations in this run and its rounds (the invocation's, else the plan's), since
        the coordinator's last re-plan of it (`round_meets`)."""
        if self.inter_region not in ("model-average", "asgd-ga"):
            return {}
        total, count = iterations or self.context.planned_iterations, rounds or self.sync.rounds
        if total is None or count is None:
            raise ValueError(f"{self.context.function.name}: several regions, but no iterations or rounds are planned")
        if since or first_round:
            if not (since < total and first_round < count and count - first_round <= total - since):
                raise ValueError(
                    f"since {since}, first_round {first_round}: rounds {first_round}..{count - 1} do not fit "
                    f"in iterations {since}..{total - 1}"
                )
            return round_meets(total, count, since=since, first_round=first_round)
        return round_meets(total, min(count, total))

    # -- between regions ---------------------------------------------------------------------------
    # A key of the run (not of a region) is under the namespace of the region that writes it, in that
    # region's storage; ASGD-GA's global versions are in the server region's. Another region's
    # storage is reached through `self.wan` (one storage for all: the same storage, still counted).
    def _peer_namespace(self, region: str) -> str:
        return protocol.namespace(protocol.run_of(self.invocation.namespace), region)

    def _storage_of(self, region: str) -> Channel:
        """Where `region`'s keys are: this function's own storage, or the peer's across the WAN."""
        return self.channel if region == self.region else self.wan[region]

    def _peer_get(self, region: str, key: str, timeout: float) -> bytes:
        """A key of another region's, waited for (giving up when this region's run is aborted)."""
        return self._storage_of(region).get(key, timeout, abort=self.channel.check_abort)

    def _round_key(self, region: str, round_index: int, part: protocol.RoundPart) -> str:
        assert self.inter_region is not None
        return protocol.round_key(self._peer_namespace(region), self.inter_region, self.stage, round_index, part)

    def _model(self) -> dict[str, torch.Tensor]:
        """What regions share: parameters and floating-point buffers (optimizer state stays local)."""
        frozen = self.context.frozen
        return {k: v for k, v in self.context.module.state_dict().items() if v.is_floating_point() and k not in frozen}

    def _adopt(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in self.context.module.state_dict().items():
                if name in values:
                    tensor.copy_(values[name])

    def cross_reduce(self, iteration: int, replica: int, timeout: float) -> None:
        """Synchronous cross-region SGD: the stage's gradients (summed over its replicas and tied
        partners) meet those of its counterparts in every other region. Replica 0 writes its region's
        in its own storage, reads every other region's, and takes their mean weighted by each region's
        share of the iteration's samples (`Region.weight`), in region order, so that every region computes the same
        bits and takes the same optimizer step; it leaves the result for its replicas. Floating-point
        buffers are averaged alike."""
        params = [p for _, p in self.context.trained_parameters()]
        buffers = [b for _, b in self.context.module.named_buffers() if b.is_floating_point()]
        if not params and not buffers:  # a stage of frozen parameters only: nothing its regions share
            return
        result_key = protocol.cross_key(self.invocation.namespace, iteration, self.stage, "result")
        if replica != 0:
            total = unpack(self.channel.get(result_key, timeout))["flat"]
        else:
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                + [b.reshape(-1) for b in buffers]
            )
            weight = torch.tensor(self.weight, dtype=torch.float64)
            own = protocol.cross_key(self.invocation.namespace, iteration, self.stage, "sums")
            self._contribute(own, pack({"flat": flat, ROUND_WEIGHT: weight}), iteration)
            parts: list[tuple[float, dict[str, torch.Tensor]]] = []
            for region, _ in self.peers:
                if region == self.region:
                    parts.append((self.weight, {"flat": flat}))
                    continue
                key = protocol.cross_key(self._peer_namespace(region), iteration, self.stage, "sums")
                data = self._contribution(region, key, timeout)
                if data is not None:
                    theirs = unpack(data)
                    parts.append((float(theirs.pop(ROUND_WEIGHT)), theirs))
            total = weighted_mean(parts)["flat"]
            if self.invocation.replicas > 1:
                self.channel.put(result_key, pack({"flat": total}))
        offset = 0
        for p in params:
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        with torch.no_grad():
            for b in buffers:
                b.copy_(total[offset : offset + b.numel()].view_as(b))
                offset += b.numel()

    def meet(self, round_index: int, replica: int, timeout: float) -> None:
        """This stage's round-end sync with the other regions. Replica 0 talks across regions and
        leaves the result in its own region's storage; the other replicas read it there."""
        result_key = self._round_key(self.region, round_index, "result")
        if replica != 0:
            result = unpack(self.channel.get(result_key, timeout))
            self.base_version = int(result.pop(protocol.ROUND_VERSION, torch.tensor(0)))
            self._adopt(result)
            return
        if self.inter_region == "model-average":
            merged = self._model_average(round_index, timeout)
        else:
            merged = self._asgd_push(round_index, timeout)
        self._adopt(merged)
        if self.invocation.replicas > 1:
            extra = {protocol.ROUND_VERSION: torch.tensor(self.base_version)} if self.inter_region == "asgd-ga" else {}
            self.channel.put(result_key, pack({**merged, **extra}))

    def _model_average(self, round_index: int, timeout: float) -> dict[str, torch.Tensor]:
        """Every region writes its model for the round (with its weight, its share of the round's
        samples) in its own storage, reads the others' from theirs and takes the weighted mean, in
        region order (so every region gets the same bits). A region missing from the meet longer than
        the region timeout is left out (`_contribution`); the mean is then over those present. What
        was averaged is recorded beside the model (`members`)."""
        mine = self._model()
        weight = torch.tensor(self.weight, dtype=torch.float64)
        self._contribute(
            self._round_key(self.region, round_index, "model"), pack({**mine, ROUND_WEIGHT: weight}), round_index
        )
        parts: list[tuple[float, dict[str, torch.Tensor]]] = []
        members: dict[str, float] = {}
        for region, _ in self.peers:
            if region == self.region:
                parts.append((self.weight, mine))
                members[region] = self.weight
                continue
            data = self._contribution(region, self._round_key(region, round_index, "model"), timeout)
            if data is not None:
                theirs = unpack(data)
                members[region] = float(theirs.pop(ROUND_WEIGHT))
                parts.append((members[region], theirs))
        self.channel.put(self._round_key(self.region, round_index, "members"), json.dumps(members).encode())
        total = weighted_mean(parts)
        return {name: value.to(mine[name].dtype) for name, value in total.items()}

    def _contribute(self, key: str, data: bytes, step: int) -> None:
        """Write this region's contribution to a meet, create-if-absent: a region that stopped waiting
        for it may have claimed the key first (`protocol.LEFT_MARK`), and then this region has left
        the run (RegionLeft). A retry finds its own earlier write (the same bytes) and goes on."""
        if self.channel.claim(key, data) or self.channel.try_get(key) != LEFT_MARK:
            return
        message = (
            f"region {self.region} left the run at meet {step} (stage {self.stage}): the other regions "
            "went on without it (it missed a meet by the region timeout)"
        )
        raise RegionLeft(AbortRecord("left", message, step, self.stage, self.context.function.name))

    def _contribution(self, region: str, key: str, timeout: float) -> bytes | None:
        """Another region's contribution to a meet, or None if that region left the run. Waits up to the
        region timeout, then claims the key with LEFT_MARK (create-if-absent: if the region's own write
        wins, it counts; either way every region that reads the key agrees), and records the departure
        (`left_key`), after which a missing contribution of that region is marked at once."""
        if region in self.departed:
            return None
        storage = self._storage_of(region)
        left = protocol.left_key(self._peer_namespace(region))
        clock = Backoff(storage.poll_s, storage.max_poll_s, timeout, check_at_once=True)
        while True:
            data = storage.try_get(key)
            if data is not None:
                if data == LEFT_MARK:
                    self.departed.add(region)
                    return None
                return data
            late = self.region_timeout is not None and clock.elapsed >= self.region_timeout
            second = clock.once_a_second()
            if late or (second and storage.exists(left)):
                if storage.claim(key, LEFT_MARK):
                    why = f"{region} missed meet of {key.rsplit('/', 2)[-2]} by {clock.elapsed:.0f} s"
                    storage.claim(left, json.dumps({"by": self.region, "why": why}).encode())
                    self.departed.add(region)
                    return None
                continue  # its contribution (or another region's mark) landed meanwhile: read it
            if clock.expired():
                raise KeyTimeout(f"{storage.describe(key)} did not appear within {timeout:g} s")
            if second:
                self.channel.check_abort()
            clock.pause()

    def _global_key(self, version: int, part: GlobalPart) -> str:
        assert self.server is not None
        return protocol.global_key(self._peer_namespace(self.server), self.stage, version, part)

    def _global(self, version: int, timeout: float) -> dict[str, torch.Tensor]:
        """Version `version` of the stage's global model. A version claimed by a region that left the run
        before writing it (killed between its claim and its write) is never written: the version before
        it stands for it, else every later push would wait for it."""
        while version > 0:
            data = self._written_version(version, timeout)
            if data is not None:
                return unpack(data)
            version -= 1
        # every region starts from the package's weights
        initial = self._initial_weights()
        return {k: v for k, v in initial.items() if k in self._model()}

    def _written_version(self, version: int, timeout: float) -> bytes | None:
        """The bytes of a global version, waited for; None when its owner left the run without them."""
        assert self.server is not None
        server = self._storage_of(self.server)
        key = self._global_key(version, "model")
        clock = Backoff(server.poll_s, server.max_poll_s, timeout, check_at_once=True)
        region = ""
        while True:
            data = server.try_get(key)
            if data == LEFT_MARK:  # its owner was given up: see below
                if region:
                    self.departed.add(region)
                return None
            if data is not None:
                return data
            if clock.once_a_second():
                self.channel.check_abort()
                owner = (server.try_get(self._global_key(version, "owner")) or b"").decode(errors="replace")
                region = owner.rsplit("/round", 1)[0]
                if region not in self._storage_names() or region == self.region:
                    region = ""
                elif region in self.departed or self._storage_of(region).exists(
                    protocol.left_key(self._peer_namespace(region))
                ):
                    self.departed.add(region)
                    return None
            # An owner silent past the region timeout (killed between its claim and its write, with no one
            # to record its departure) is given up as a missed meet is: the version is claimed void
            # (create-if-absent: if its write wins, it counts) and its departure recorded.
            if region and self.region_timeout is not None and clock.elapsed >= self.region_timeout:
                if server.claim(key, LEFT_MARK):
                    why = f"{region} did not write global version {version} within {clock.elapsed:.0f} s"
                    left = protocol.left_key(self._peer_namespace(region))
                    self._storage_of(region).claim(left, json.dumps({"by": self.region, "why": why}).encode())
                    self.departed.add(region)
                    return None
                continue  # its write (or another region's mark) landed meanwhile: read it
            if clock.expired():
                raise KeyTimeout(f"{server.describe(key)} did not appear within {timeout:g} s")
            clock.pause()

    def _storage_names(self) -> set[str]:
        """The regions whose storage this function reaches: its own, and every peer's across the WAN."""
        return {self.region, *self.wan}

    def push_update(
        self, previous: dict[str, torch.Tensor], base: dict[str, torch.Tensor], staleness: int
    ) -> tuple[dict[str, torch.Tensor], float, bool]:
        """ASGD-GA: the version a push of `staleness` makes from the newest one (`previous`) and the
        version its round started from (`base`); the factor its update is applied with; whether it
        was rebased.

        A region's update (its model now minus `base`) counts with its weight w (its share of a
        round's samples; 1/R without one): when the regions push from the same base, the global
        model moves as model averaging moves it, where adding every region's full update moved it R
        times as far (which diverged). Every push lands on the newest version, and the region starts
        its next round from the version it made. A push whose base lags more than `staleness_bound`
        versions is rebased: applied onto the newest version all the same, at its weight (not dropped,
        not damped: damping by (1 + bound) / (1 + staleness), or mixing the newest version toward
        the region's model, each cost accuracy on the geo sample, where a region pushing fewer, longer
        rounds is stale by construction), and reported as such (`PushRecord.rebased`)."""
        mine = self._model()
        weight = self.weight
        bound = self.sync.staleness_bound
        rebased = bound is not None and staleness > bound
        merged = {name: previous[name] + weight * (mine[name] - base[name]) for name in mine}
        return {name: value.to(mine[name].dtype) for name, value in merged.items()}, weight, rebased

    def _asgd_push(self, round_index: int, timeout: float) -> dict[str, torch.Tensor]:
        """ASGD-GA: apply this round's update (`push_update`) to the newest global version, as the
        next version, without waiting for any other region; record the push beside it
        (`PushRecord`). Versions are claimed with create-if-absent in the server region's storage; a
        retried push finds its own claim and rewrites the same bytes, so an update is never applied
        twice."""
        assert self.server is not None
        server = self._storage_of(self.server)
        me = protocol.global_owner(self.region, round_index)
        base = self._global(self.base_version, timeout)
        version = self.base_version + 1
        while True:
            owner = server.try_get(self._global_key(version, "owner"))
            if owner is None and server.claim(self._global_key(version, "owner"), me):
                owner = me
            elif owner is None:
                owner = self._peer_get(self.server, self._global_key(version, "owner"), timeout)
            if owner == me:
                staleness = version - 1 - self.base_version
                previous = self._global(version - 1, timeout)
                merged, scale, rebased = self.push_update(previous, base, staleness)
                record = PushRecord(
                    self.region, round_index, self.stage, self.base_version, version, staleness, scale, rebased
                )
                server.put(self._global_key(version, "push"), record.encode())
                # create-if-absent: a region that stopped waiting for this version may have voided it
                # (LEFT_MARK), and then this region has left the run; a retry finds its own bytes
                model_key = self._global_key(version, "model")
                if not server.claim(model_key, pack(merged)) and server.try_get(model_key) == LEFT_MARK:
                    message = (
                        f"region {self.region} left the run at global version {version} (stage {self.stage}): the "
                        "other regions went on without it (it did not write the version by the region timeout)"
                    )
                    raise RegionLeft(AbortRecord("left", message, round_index, self.stage, self.context.function.name))
                self.base_version = version
                return merged
            version += 1


def weighted_mean(parts: list[tuple[float, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Sum of weight x values over `parts` in their order, divided by the weights' sum unless that is
    1 (a region left, or the regions' plans changed at different meets)."""
    total: dict[str, torch.Tensor] = {}
    for weight, values in parts:
        for name, value in values.items():
            total[name] = total[name] + weight * value if name in total else weight * value
    weights = math.fsum(weight for weight, _ in parts)
    if abs(weights - 1.0) > 1e-9:
        total = {name: value / weights for name, value in total.items()}
    return total
