"""The serverless cost model: one place for every predicted time, memory and dollar.

Used by the MILP planner (as coefficients), the exhaustive search, the baselines, the report, and
to parameterise the event simulator (which derives its timeline independently). Formulas are
documented in docs/cost_model.md; symbols below follow it.

Scaling from the profile: block times were measured at micro-batch mu_p on `threads` threads of a
machine doing `reference_gflops`; on a function of tier m at micro-batch mu they take
    t * (mu / mu_p) * kappa(m),   kappa(m) = reference_gflops / (gflops_per_vcpu * vcpus(m))
(linear in the micro-batch, as FuncPipe fitted; inversely proportional to the CPU share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ...ir import BlockChain
from ...ir.catalog import PlatformLimits, Region
from ...ir.sample_order import HELD_SHARDS, staged_shard_samples
from ...ir.schedule import SYNC_IN_FLIGHT, SYNC_MAX_POLL_S, Schedule, sync_pieces
from ..errors import CompileError

Objective = Literal["cost", "time", "cost-under-deadline", "time-under-budget"]
MB = 2**20
#: The most one iteration of the simplest plan (the whole model in one function) may take and cost. A
#: region whose figures exceed them (a bandwidth or a CPU share near zero, prices near infinity) is
#: outside any deployment, and outside the range of coefficients the MILP solvers handle.
MAX_ITERATION_S = 1e9
MAX_ITERATION_USD = 1e9


class OutOfRange(CompileError):
    """A catalog region's figures put every plan's time or cost beyond what can be planned."""


@dataclass(frozen=True)
class BlockCost:
    """One block's measured and annotated costs at the profiled micro-batch."""

    forward_s: float
    backward_s: float
    param_bytes: int  # trainable, excluding parameters shared with other blocks (counted per stage)
    buffer_bytes: int
    saved_bytes: int
    input_bytes: int
    output_bytes: int
    shared: tuple[str, ...] = ()
    #: buffers the block's forward changes in an order replicas cannot reproduce: its stage runs one replica
    sequenced: tuple[str, ...] = ()


#: checkpoints per run when the model file does not say (at least every 1000 iterations)
CHECKPOINTS_PER_RUN = 4


def checkpoint_interval(iterations: int) -> int:
    """Iterations between two checkpoints of a run of `iterations`."""
    return max(1, min(1000, math.ceil(iterations / CHECKPOINTS_PER_RUN)))


@dataclass(frozen=True)
class DataInPlace:
    """What a first stage reading training data where it lies holds and reads (from the split's index)."""

    #: bytes of shards it holds at once: `sample_order.HELD_SHARDS` of the largest
    held_bytes: int
    #: stored bytes per sample, and samples per shard (a GET each); None: not counted (TRAINING['iterations']
    #: in one region reads the shards' sizes only), the micro-batch's tensor bytes then stand in
    bytes_per_sample: float | None = None
    samples_per_shard: float | None = None


@dataclass(frozen=True)
class Problem:
    """Everything a plan is chosen from, in one region."""

    blocks: tuple[BlockCost, ...]
    shared_bytes: dict[str, int]
    profile_batch: int
    reference_gflops: float
    threads: int
    region: Region
    global_batch: int
    micro_batches: tuple[int, ...]
    replicas: tuple[int, ...] = (1, 2, 4, 8)
    max_stages: int = 16
    #: at least this many stages (--stages N plans exactly N: min_stages = max_stages = N)
    min_stages: int = 1
    #: TRAINING["max_grad_norm"]: each iteration, every function exchanges the stages' squared norms
    clipped: bool = False
    max_functions: int | None = None
    schedule: Schedule = "gpipe"
    optimizer_state: int = 0
    iterations: int = 1
    samples_per_epoch: int | None = None
    #: the training data where it lies (None: staged data, read from Cloudless's own shards)
    data: DataInPlace | None = None
    #: the limits of the deployment platforms built for the region (problem_from_chain applies their replica
    #: and stage limits to `replicas` and `max_stages`; `function_limit` includes their worker limit)
    platform: PlatformLimits = field(default_factory=PlatformLimits)

    def sequenced(self, first: int, last: int) -> list[str]:
        """The buffers blocks first..last change in an order replicas cannot reproduce (one replica for them)."""
        return list(dict.fromkeys(n for b in self.blocks[first : last + 1] for n in b.sequenced))

    @property
    def invocation_iterations(self) -> int:
        """Iterations one deployed invocation runs, for the cost of invocations: a checkpoint interval (the
        state machine runs ranges of at most that many; fewer only when an iteration takes more than a
        quarter of the time limit over that many, which the plan's time would show anyway)."""
        return checkpoint_interval(self.iterations)

    @property
    def function_limit(self) -> int:
        """The most functions (all stages' replicas) a plan may use: the region's limit, --max-functions, and
        the deployment platforms' (a Step Functions Map runs all of an aws region's workers at once)."""
        limit = self.region.max_functions
        if self.platform.workers is not None:
            limit = min(limit, self.platform.workers.value)
        return min(limit, self.max_functions) if self.max_functions else limit

    def function_limit_source(self) -> str:
        """What sets `function_limit`, and how to lift it."""
        limit = self.function_limit
        if self.max_functions and self.max_functions == limit:
            return f"--max-functions {limit}"
        workers = self.platform.workers
        if workers is not None and workers.value == limit:
            return f"{workers.what} ({workers.lift})"
        return f"the catalog's limits.max_functions {limit} of {self.region.name}"

    def stage_limit_source(self) -> str:
        """What sets `max_stages` (when the blocks do not), and how to lift it."""
        stages = self.platform.stages
        if stages is not None and stages.value == self.max_stages:
            return f"{stages.what} ({stages.lift})"
        return f"--max-stages {self.max_stages}"

    def limits_hint(self) -> str:
        """How to allow more functions and stages: each limit that binds, named with how to lift it."""
        return f"allow more functions (now {self.function_limit_source()}) or stages (now {self.stage_limit_source()})"

    def micro_batch_counts(self) -> dict[int, int]:
        """Candidate micro-batch sizes that divide the global batch, with their count M."""
        return {mu: self.global_batch // mu for mu in self.micro_batches if self.global_batch % mu == 0}


@dataclass(frozen=True)
class StageChoice:
    first: int
    last: int
    tier_mb: int
    replicas: int


@dataclass(frozen=True)
class Plan:
    micro_batch: int
    stages: tuple[StageChoice, ...]


@dataclass(frozen=True)
class StageTerms:
    """Per-micro-batch and per-iteration terms of one stage (seconds, MB, requests).

    Each function has a compute lane, a download link and an upload link that run at once; a
    transfer costs the request latency plus bytes over bandwidth on its link."""

    forward_compute_s: float
    backward_compute_s: float
    forward_download_s: float  # activations in (the data batch for the first stage)
    forward_upload_s: float  # activations out (0 for the last stage)
    backward_download_s: float  # output gradients in (0 for the last stage)
    backward_upload_s: float  # input gradients out (0 for the first stage)
    sync_s: float
    update_s: float
    memory_mb: float
    parameter_bytes: int
    puts: int
    gets: int

    @property
    def forward_s(self) -> float:
        """phi: a micro-batch's forward in steady state, when receives and sends overlap compute."""
        return max(self.forward_compute_s, self.forward_download_s, self.forward_upload_s)

    @property
    def backward_s(self) -> float:  # beta
        return max(self.backward_compute_s, self.backward_download_s, self.backward_upload_s)

    @property
    def forward_fill_s(self) -> float:
        """The first micro-batch's forward: its receive, compute and send cannot overlap."""
        return self.forward_download_s + self.forward_compute_s + self.forward_upload_s

    @property
    def backward_fill_s(self) -> float:
        return self.backward_download_s + self.backward_compute_s + self.backward_upload_s

    @property
    def cycle_s(self) -> float:
        """A forward and a backward in steady state under 1F1B, where they alternate on each lane."""
        return max(
            self.forward_compute_s + self.backward_compute_s,
            self.forward_download_s + self.backward_download_s,
            self.forward_upload_s + self.backward_upload_s,
        )

    @property
    def tail_s(self) -> float:
        """After the stage's last backward: scatter-reduce, then the optimizer step."""
        return self.sync_s + self.update_s


@dataclass(frozen=True)
class Evaluation:
    iteration_s: float
    cost_usd: float
    pipeline_s: float
    sync_s: float
    update_s: float
    compute_usd: float
    request_usd: float
    storage_usd: float
    stages: tuple[StageTerms, ...]
    violations: tuple[str, ...] = field(default_factory=tuple)
    warnings: tuple[str, ...] = field(default_factory=tuple)
    #: per stage, its micro-batches per replica after the first (the steady term's multipliers)
    extra: tuple[int, ...] = ()
    #: the stages whose steady term bounds the pipeline (the first on a tie): GPipe's forwards then its
    #: backwards, or 1F1B's cycles (one stage)
    bounding: tuple[int, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.violations


class CostModel:
    """Evaluates plans for one Problem; exposes the per-tier coefficients the MILP uses."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.region = problem.region
        per_vcpu = self.region.gflops_per_vcpu or problem.reference_gflops / max(problem.threads, 1)
        self._gflops_per_vcpu = per_vcpu
        # Running sums over the blocks: a stage's totals in O(1) (the planner asks for ~10^5 stages).
        self._prefix: dict[str, list[float]] = {}
        for name in ("forward_s", "backward_s", "saved_bytes", "buffer_bytes"):
            running = [0.0]
            for block in problem.blocks:
                running.append(running[-1] + getattr(block, name))
            self._prefix[name] = running
        self._params: dict[tuple[int, int], int] = {}
        self._rates: dict[int, tuple[float, float, float]] = {}

    def _tier_rates(self, tier_mb: int) -> tuple[float, float, float]:
        """kappa, bandwidth and update rate of a tier, computed once."""
        if tier_mb not in self._rates:
            self._rates[tier_mb] = (self.kappa(tier_mb), self.bandwidth(tier_mb), self.update_rate(tier_mb))
        return self._rates[tier_mb]

    def _total(self, name: str, first: int, last: int) -> float:
        prefix = self._prefix[name]
        return prefix[last + 1] - prefix[first]

    # --- per-tier coefficients -------------------------------------------------------------
    def vcpus(self, tier_mb: int) -> float:
        return self.region.vcpus(tier_mb)

    def kappa(self, tier_mb: int) -> float:
        """Measured seconds -> seconds on this tier (compute share)."""
        return self.problem.reference_gflops / (self._gflops_per_vcpu * self.vcpus(tier_mb))

    def bandwidth(self, tier_mb: int) -> float:
        """Bytes per second each way (uploads and downloads run at once)."""
        return self.region.bandwidth_bps(tier_mb)

    def update_rate(self, tier_mb: int) -> float:
        """Bytes per second the optimizer step streams."""
        return self.region.memory_gbps_per_vcpu * 1e9 * self.vcpus(tier_mb)

    @property
    def latency(self) -> float:
        return self.region.request_latency_s

    @staticmethod
    def in_flight(schedule: Schedule, per_replica: int, stages_from_here: int) -> int:
        """Micro-batches whose activations a replica holds: all of its own under GPipe, at most the
        number of stages from here to the end under 1F1B."""
        return per_replica if schedule == "gpipe" else min(per_replica, stages_from_here)

    def sync_time(self, param_bytes: float, replicas: int, tier_mb: int, in_flight: int = SYNC_IN_FLIGHT) -> float:
        """Pipelined scatter-reduce among `replicas` (runtimes/function/scatter_reduce.py): each downlink
        receives 2(r-1) chunks of P/r bytes (its own chunk from every other replica, then every other reduced chunk) in
        k pieces of x bytes, one request each, while its uplink sends P. A request costs L + x/B, but
        each direction keeps `in_flight` requests going (runtimes.schedule.SYNC_IN_FLIGHT), so latency
        overlaps the transfers before it and a busy link moves a piece every
        tau = max(x/B, (L + x/B)/in_flight). The downlink starts once the first piece has been
        uploaded and fetched, 2(L + x/B) in; the reduced chunks follow its own chunk without a gap,
        unless (few pieces) the first reduced piece is not uploaded yet: that needs its owner's
        uplink through the (r-1)k scattered pieces and its owner's first round of r-1 pieces reduced.
        A piece a downlink waits for is found (L + p)/2 after it is written on average (it polls at
        most p = SYNC_MAX_POLL_S apart, each poll a request): charged once in each phase."""
        r = replicas
        if r <= 1:
            return 0.0
        k = sync_pieces(param_bytes, r)
        transfer = param_bytes / (r * k) / self.bandwidth(tier_mb)
        request = self.latency + transfer
        tau = max(transfer, request / in_flight)
        detect = (self.latency + SYNC_MAX_POLL_S) / 2
        scattered = (r - 1) * k  # pieces each downlink receives in either phase
        own_chunk = 2 * request + detect + (scattered - 1) * tau
        first_round = 2 * request + detect + (r - 2) * tau  # the owner holds piece 0 from every other replica
        reduced_up = max(request + scattered * tau, first_round + request)
        return max(own_chunk + tau, reduced_up + request + detect) + (scattered - 1) * tau

    # --- one stage -------------------------------------------------------------------------
    def stage_params(self, first: int, last: int) -> int:
        found = self._params.get((first, last))
        if found is None:
            blocks = self.problem.blocks[first : last + 1]
            shared = {name for b in blocks for name in b.shared}
            found = sum(b.param_bytes for b in blocks) + sum(self.problem.shared_bytes[n] for n in shared)
            self._params[first, last] = found
        return found

    def parameter_state_bytes(self, params: float) -> float:
        """Parameters, their gradients and the optimizer's state (k_opt copies): what a stage holds
        per trainable byte, and what its optimizer step streams."""
        return (2 + self.problem.optimizer_state) * params

    def model_state_bytes(self, first: int, last: int) -> float:
        """The model state of blocks first..last: parameters, gradients and optimizer state of their
        trainable parameters (shared ones once), and their buffers. A whole model's is
        model_state_bytes(0, len(blocks) - 1)."""
        params = self.parameter_state_bytes(self.stage_params(first, last))
        return params + self._total("buffer_bytes", first, last)

    def stage_terms(self, choice: StageChoice, index: int, count: int, micro_batch: int) -> StageTerms:
        """Terms of the stage at `index` of `count` stages."""
        return self.config_terms(choice, index == 0, index == count - 1, count - index, micro_batch)

    def config_terms(
        self, choice: StageChoice, first: bool, last: bool, stages_from_here: int, micro_batch: int
    ) -> StageTerms:
        """Terms of a stage configuration from what it alone determines: whether it is the first
        and the last stage, and (1F1B memory only) how many stages run from it to the end."""
        p = self.problem
        scale = micro_batch / p.profile_batch
        micro_batches = p.global_batch // micro_batch
        per_replica = math.ceil(micro_batches / choice.replicas)
        kappa, bandwidth, update_rate = self._tier_rates(choice.tier_mb)
        inputs = scale * p.blocks[choice.first].input_bytes
        outputs = scale * p.blocks[choice.last].output_bytes if not last else 0.0
        grad_in = inputs if not first else 0.0
        params = self.stage_params(choice.first, choice.last)
        state = self.model_state_bytes(choice.first, choice.last)
        activations = scale * self._total("saved_bytes", choice.first, choice.last)
        held = self.in_flight(p.schedule, per_replica, stages_from_here)
        memory = self.region.runtime_overhead_mb + (state + activations * held + 2 * (inputs + outputs)) / MB
        if first:  # the shards its cache holds
            memory += self.first_stage_held_bytes() / MB
        r = choice.replicas
        pieces = sync_pieces(params, r)
        # Besides tensors (counts over the stage's r replicas): each last-stage replica reports its
        # losses (a put), every replica reads whether its invocation ends here (a get), and a first
        # stage reads a data shard.
        puts = (2 * micro_batches if not last else r) + (r * r * pieces if r > 1 else 0)
        # Clipping: replica 0 writes the stage's squared norm, then every replica reads the other stages'
        # at once (a put, a get and the wait to find it). Their GETs, S-1 per replica, depend on the stage
        # count, which a stage's terms do not know: left out (S3: $0.4 per million).
        clip_s = 0.0
        if p.clipped:  # alone (first and last), a stage writes its norm and reads none
            clip_s = self.latency if first and last else 2 * self.latency + (self.latency + SYNC_MAX_POLL_S) / 2
        puts += 1 if p.clipped else 0
        gets = r + (1 if first else 2 * micro_batches) + (2 * r * (r - 1) * pieces if r > 1 else 0)

        def transfer(size: float) -> float:
            return size / bandwidth + self.latency if size else 0.0

        return StageTerms(
            forward_compute_s=kappa * scale * self._total("forward_s", choice.first, choice.last),
            backward_compute_s=kappa * scale * self._total("backward_s", choice.first, choice.last),
            forward_download_s=self.first_stage_read_s(micro_batch, inputs, bandwidth) if first else transfer(inputs),
            forward_upload_s=transfer(outputs),
            backward_download_s=transfer(outputs),
            backward_upload_s=transfer(grad_in),
            sync_s=self.sync_time(params, r, choice.tier_mb) + clip_s,
            update_s=self.parameter_state_bytes(params) / update_rate,
            memory_mb=memory,
            parameter_bytes=params,
            puts=puts,
            gets=gets,
        )

    def _staged_sample(self) -> tuple[float, int]:
        """Staged data's bytes per sample (the model's inputs), and samples per staged shard."""
        p = self.problem
        sample = p.blocks[0].input_bytes / p.profile_batch
        return sample, staged_shard_samples(math.ceil(sample))

    def first_stage_held_bytes(self) -> float:
        """What a first stage's shards take at most: `HELD_SHARDS` (of the largest shard where data lies;
        staged shards of the sample's bytes, no more than the split when it is counted)."""
        p = self.problem
        if p.data is not None:
            return p.data.held_bytes
        sample, shard = self._staged_sample()
        held = HELD_SHARDS * shard
        return sample * (min(held, p.samples_per_epoch) if p.samples_per_epoch else held)

    def first_stage_read_s(self, micro_batch: int, inputs: float, bandwidth: float) -> float:
        """A micro-batch's share of the shards a first stage reads: each shard read once, whole (a request per
        shard). Staged shards hold the micro-batch's tensors (`sample_order.staged_shard_samples` a shard);
        shards where they lie hold the samples as stored (a JPEG, a Parquet row), their bytes and counts from
        the index."""
        data = self.problem.data
        if data is None or data.bytes_per_sample is None or not data.samples_per_shard:
            return inputs / bandwidth + self.latency * micro_batch / self._staged_sample()[1]
        return micro_batch * (data.bytes_per_sample / bandwidth + self.latency / data.samples_per_shard)

    def request_usd(self, choice: StageChoice) -> float:
        """Per iteration, what a stage's invocations cost as deployed: one invocation of each replica runs
        `invocation_iterations` iterations (the state machine's range), so per iteration its request, its
        state transitions (invoke, check, pass: 3 per worker and round; the round's own 5 are left out) and
        the checkpoint replica 0 writes when the invocation ends, each over that many iterations."""
        prices = self.region.prices
        per_invocation = (
            choice.replicas * (prices.per_million_requests / 1e6 + 3 * prices.state_transition_per_1000 / 1000)
            + prices.storage_put_per_1000 / 1000
        )
        return per_invocation / self.problem.invocation_iterations

    def storage_usd(self, terms: StageTerms) -> float:
        prices = self.region.prices
        return terms.puts * prices.storage_put_per_1000 / 1000 + terms.gets * prices.storage_get_per_1000 / 1000

    # --- a whole plan ----------------------------------------------------------------------
    def evaluate(self, plan: Plan) -> Evaluation:
        p = self.problem
        count = len(plan.stages)
        terms = tuple(self.stage_terms(c, i, count, plan.micro_batch) for i, c in enumerate(plan.stages))
        micro_batches = p.global_batch // plan.micro_batch
        extra = [math.ceil(micro_batches / c.replicas) - 1 for c in plan.stages]
        fill = sum(t.forward_fill_s + t.backward_fill_s for t in terms)
        bounding: tuple[int, ...]
        if p.schedule == "gpipe":
            forwards = [e * t.forward_s for e, t in zip(extra, terms, strict=True)]
            drains = [e * t.backward_s for e, t in zip(extra, terms, strict=True)]
            bounding = (_first_max(forwards), _first_max(drains))
            steady = forwards[bounding[0]] + drains[bounding[1]]
        else:
            drains = [e * t.cycle_s for e, t in zip(extra, terms, strict=True)]
            bounding = (_first_max(drains),)
            steady = drains[bounding[0]]
        pipeline = fill + steady
        # A stage syncs and steps as soon as its own last backward is done: the stages before it
        # still run their backward fill, and the drain of the busiest stage before it has not
        # delayed it. The iteration ends with the stage that finishes last.
        overhang, before = 0.0, 0.0
        critical = terms[0]
        for s, t in enumerate(terms):
            ends = t.tail_s - before - (max(drains) - max(drains[s:]))
            if ends > overhang:
                overhang, critical = ends, t
            before += t.backward_fill_s
        sync, update = critical.sync_s, critical.update_s
        iteration = pipeline + overhang
        prices = self.region.prices
        gb_functions = sum(c.replicas * c.tier_mb / 1024 for c in plan.stages)
        compute_usd = iteration * gb_functions * prices.gb_second
        request_usd = sum(self.request_usd(c) for c in plan.stages)
        storage_usd = sum(self.storage_usd(t) for t in terms)
        violations = self.violations(plan, terms)
        return Evaluation(
            iteration_s=iteration,
            cost_usd=compute_usd + request_usd + storage_usd,
            pipeline_s=pipeline,
            sync_s=sync,
            update_s=update,
            compute_usd=compute_usd,
            request_usd=request_usd,
            storage_usd=storage_usd,
            stages=terms,
            violations=tuple(violations),
            warnings=tuple(self.round_trip_warnings(terms)),
            extra=tuple(extra),
            bounding=bounding,
        )

    def round_trip_warnings(self, terms: tuple[StageTerms, ...]) -> list[str]:
        """1F1B keeps (stages from here) micro-batches in flight per replica; the steady term above
        assumes they cover the round trip of one micro-batch to the last stage and back. When they
        do not, the stage waits and the prediction is optimistic (the simulator shows by how much)."""
        if self.problem.schedule != "1f1b":
            return []
        found = []
        for s, t in enumerate(terms):
            after = len(terms) - s
            round_trip = sum(u.forward_fill_s + u.backward_fill_s for u in terms[s:])
            round_trip -= t.forward_download_s + t.backward_upload_s
            if round_trip > after * t.cycle_s * 1.1:
                found.append(
                    f"stage {s}: under 1F1B its {after} micro-batches in flight wait for a {round_trip:.3f} s round "
                    f"trip against a {t.cycle_s:.3f} s cycle; the predicted time is optimistic (try --schedule gpipe)"
                )
        return found

    def violations(self, plan: Plan, terms: tuple[StageTerms, ...]) -> list[str]:
        found = []
        for i, (choice, t) in enumerate(zip(plan.stages, terms, strict=True)):
            if t.memory_mb > choice.tier_mb:
                found.append(
                    f"stage {i} (blocks {choice.first}-{choice.last}) needs {t.memory_mb:.0f} MB, "
                    f"more than its {choice.tier_mb} MB tier"
                )
        for i, choice in enumerate(plan.stages):
            held = self.problem.sequenced(choice.first, choice.last)
            if choice.replicas > 1 and held:
                found.append(
                    f"stage {i} runs {choice.replicas} replicas, but its forward changes {held[0]} in sequence"
                )
        functions = sum(c.replicas for c in plan.stages)
        if functions > self.problem.function_limit:
            found.append(f"{functions} functions exceed the limit of {self.problem.function_limit}")
        if len(plan.stages) > self.problem.max_stages:
            found.append(f"{len(plan.stages)} stages exceed the limit of {self.problem.max_stages}")
        return found


def _first_max(values: list[float]) -> int:
    """The index of the largest value, the first on a tie."""
    return max(range(len(values)), key=values.__getitem__)


def check_range(problem: Problem) -> None:
    """Raise OutOfRange when the problem's region gives the simplest plan (the whole model in one function,
    on every tier, at the largest micro-batch) a time or cost that is not finite or beyond MAX_ITERATION_S or
    MAX_ITERATION_USD on every tier: what the catalog says of the region is then far outside any real platform.
    Zero figures (free, instant) are fine."""
    counts = problem.micro_batch_counts()
    if not problem.blocks or not counts:
        return
    model = CostModel(problem)
    region = problem.region
    last = len(problem.blocks) - 1
    mu = max(counts)
    evaluations = {m: model.evaluate(Plan(mu, (StageChoice(0, last, m, 1),))) for m in region.tiers_mb}
    fastest = min(region.tiers_mb, key=lambda m: _ordered(evaluations[m].iteration_s))
    seconds = evaluations[fastest].iteration_s
    if not seconds <= MAX_ITERATION_S:
        rates = model._tier_rates(fastest)
        raise OutOfRange(
            f"catalog region {region.name}: its figures make one iteration take {seconds:.3g} s even as one "
            f"function of {fastest} MB ({model.vcpus(fastest):.3g} vCPUs, compute {rates[0]:.3g}x the profiling "
            f"machine's time, {rates[1] / 1e6:.3g} MB/s and {region.request_latency_s:.3g} s per request to storage, "
            f"optimizer step at {rates[2] / 1e9:.3g} GB/s); beyond {MAX_ITERATION_S:.0e} s is no plan: check the "
            "region's cpu, network and memory figures"
        )
    cheapest = min(region.tiers_mb, key=lambda m: _ordered(evaluations[m].cost_usd))
    usd = evaluations[cheapest].cost_usd
    if not usd <= MAX_ITERATION_USD:
        raise OutOfRange(
            f"catalog region {region.name}: its prices make one iteration cost {usd:.3g} USD even as one function "
            f"of {cheapest} MB; beyond {MAX_ITERATION_USD:.0e} USD is no plan: check the region's prices"
        )


def _ordered(value: float) -> float:
    """NaN sorts last (as infinity), so that min() finds a finite figure when there is one."""
    return value if not math.isnan(value) else math.inf


def problem_from_chain(
    chain: BlockChain,
    region: Region,
    *,
    global_batch: int,
    micro_batches: tuple[int, ...],
    schedule: Schedule = "gpipe",
    optimizer_state: int = 0,
    replicas: tuple[int, ...] = (1, 2, 4, 8),
    max_stages: int = 16,
    max_functions: int | None = None,
    iterations: int = 1,
    samples_per_epoch: int | None = None,
    platform: PlatformLimits | None = None,
    data: DataInPlace | None = None,
) -> Problem:
    """The planning problem for a profiled block chain in one region, within the `platform` limits of the
    deployment files built for it (replica counts above their replica limit are left out: CompileError when
    none is left; the stage limit lowers max_stages)."""
    platform = platform or PlatformLimits()
    if platform.replicas is not None:
        allowed = tuple(r for r in replicas if r <= platform.replicas.value)
        if replicas and not allowed:
            bound = platform.replicas
            raise CompileError(
                f"no plan fits: every replica count of --replicas {','.join(map(str, replicas))} exceeds {bound.what}; "
                f"use replica counts of at most {bound.value}, or {bound.lift}"
            )
        replicas = allowed
    if platform.stages is not None:
        max_stages = min(max_stages, platform.stages.value)
    if chain.machine is None:
        raise ValueError("the block chain has no measured times; profile it first (--repeats >= 1)")
    shared, sequenced = set(chain.shared_params), set(chain.sequenced)
    blocks = tuple(
        BlockCost(
            forward_s=b.forward_s,
            backward_s=b.backward_s,
            param_bytes=b.param_bytes - sum(chain.shared_params[n] for n in b.params if n in shared),
            buffer_bytes=b.buffer_bytes,
            saved_bytes=b.saved_bytes,
            input_bytes=b.input_bytes,
            output_bytes=b.output_bytes,
            shared=tuple(n for n in b.params if n in shared),
            sequenced=tuple(n for n in b.params if n in sequenced),
        )
        for b in chain.blocks
    )
    problem = Problem(
        blocks=blocks,
        shared_bytes=dict(chain.shared_params),
        profile_batch=chain.batch_size,
        reference_gflops=chain.machine.reference_gflops,
        threads=chain.machine.threads,
        region=region,
        global_batch=global_batch,
        micro_batches=micro_batches,
        replicas=replicas,
        max_stages=min(max_stages, len(blocks)),
        max_functions=max_functions,
        schedule=schedule,
        optimizer_state=optimizer_state,
        iterations=iterations,
        samples_per_epoch=samples_per_epoch,
        data=data,
        platform=platform,
    )
    check_replicas(problem)
    check_range(problem)
    return problem


def check_replicas(problem: Problem) -> None:
    """CompileError when no replica count fits the function limit (no stage could be planned at all), or
    when the counts exclude the one replica a stage holding a buffer changed in sequence runs."""
    held = problem.sequenced(0, len(problem.blocks) - 1)
    if held and 1 not in problem.replicas:
        raise CompileError(
            f"no plan fits: the model's forward changes buffer {held[0]} in place, in an order a stage's replicas "
            "cannot reproduce (each would start from the iteration's value), so its stage runs one replica, which "
            f"--replicas {','.join(map(str, problem.replicas))} excludes; include 1 (e.g. --replicas 1,2)"
        )
    limit = problem.function_limit
    if not problem.replicas or min(problem.replicas) <= limit:
        return
    raise CompileError(
        f"no plan fits: every replica count of --replicas {','.join(map(str, problem.replicas))} exceeds "
        f"{problem.function_limit_source()}; use replica counts of at most {limit}"
    )
