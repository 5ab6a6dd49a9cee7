"""How `explain` puts plans and the difference between two of them into words: a plan's shape, the
amounts in the objective's unit, and the term a plan loses most by, with what it is made of."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from ...codegen.numbers import fmt
from .cost_model import MB, CostModel, Evaluation, Plan, Problem

#: the terms of an iteration's time, in the order ties are broken (the first wins)
TIME_TERMS = ("compute", "data loading", "stage transfers", "gradient sync", "optimizer update")
#: the terms of its cost: functions alive through each time term, then the requests
COST_TERMS = (*TIME_TERMS, "invocations", "storage requests")
#: two figures this close (relative) are a tie: above the solver's relative gap (solver.GAP, 1e-7), so that a
#: family's best never looks better than a plan the solver proved optimal
TIE = 1e-6

Unit = Literal["s", "USD"]


def describe_plan(plan: Plan) -> str:
    """`8 × 10240 MB, whole model, micro-batch 8`, `2 stages (blocks 0–3 | 4–7) of 8 × 10240 MB, micro-batch
    512`, or each stage's blocks and functions when they differ."""
    stages = plan.stages
    if len(stages) == 1:
        c = stages[0]
        return f"{c.replicas} × {c.tier_mb} MB, whole model, micro-batch {plan.micro_batch}"
    ranges = " | ".join(_blocks(c.first, c.last) for c in stages)
    if len({(c.tier_mb, c.replicas) for c in stages}) == 1:
        c = stages[0]
        return (
            f"{len(stages)} stages (blocks {ranges}) of {c.replicas} × {c.tier_mb} MB, micro-batch {plan.micro_batch}"
        )
    each = "; ".join(f"blocks {_blocks(c.first, c.last)} on {c.replicas} × {c.tier_mb} MB" for c in stages)
    return f"{len(stages)} stages ({each}), micro-batch {plan.micro_batch}"


def _blocks(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}–{last}"


def amount(value: float, unit: Unit) -> str:
    return f"{fmt(value, 3)} {unit}"


def listed(names: Sequence[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def pair(a: float, b: float, unit: Unit) -> tuple[str, str]:
    """Two figures with digits enough to tell them apart (up to 10)."""
    digits = 3
    while digits < 10 and fmt(a, digits) == fmt(b, digits):
        digits += 1
    return f"{fmt(a, digits)} {unit}", f"{fmt(b, digits)} {unit}"


def as_factor(value: float) -> str:
    """`1.9×`; near 1, digits enough to show the difference (`1.0002×`)."""
    digits = 3
    if 1 < value < 1.01:
        digits += math.ceil(-math.log10(value - 1)) - 2
    return f"{fmt(value, digits)}×"


def loss_text(
    name: str,
    values: tuple[float, float],
    unit: Unit,
    problem: Problem,
    alternative_plan: tuple[Plan, Evaluation],
    chosen_plan: tuple[Plan, Evaluation],
) -> str:
    """`<term> takes 0.54 s more (0.6 s against 0.06 s; what the alternative moves or computes)`, or
    in dollars, `<term> costs ... more (GB of functions alive for seconds against ...)`."""
    alternative, mine = values
    plan, chosen = alternative_plan[0], chosen_plan[0]
    detail = _detail(name, problem, *alternative_plan)
    if name == "invocations":
        detail += f" against {sum(c.replicas for c in chosen.stages)}"
    elif name == "storage requests":
        terms = chosen_plan[1].stages
        detail += f" against {sum(t.puts for t in terms)} and {sum(t.gets for t in terms)}"
    plural = name in _PLURAL
    if unit == "s":
        verb = "take" if plural else "takes"
        text = (
            f"{name} {verb} {amount(alternative - mine, unit)} more ({fmt(alternative, 3)} s against {fmt(mine, 3)} s"
        )
        return text + (f"; {detail})" if detail else ")")
    text = f"{name} {'cost' if plural else 'costs'} {amount(alternative - mine, unit)} more"
    if name in TIME_TERMS:
        price = problem.region.prices.gb_second
        seconds = alternative / (price * function_gb(plan)) if price > 0 else 0.0
        ours = mine / (price * function_gb(chosen)) if price > 0 else 0.0
        text += (
            f" ({fmt(function_gb(plan), 3)} GB of functions alive for {fmt(seconds, 3)} s against "
            f"{fmt(function_gb(chosen), 3)} GB for {fmt(ours, 3)} s"
        )
        return text + (f"; {detail})" if detail else ")")
    return text + (f" ({detail})" if detail else "")


#: terms that take a plural verb
_PLURAL = frozenset({"stage transfers", "invocations", "storage requests"})


def _detail(name: str, problem: Problem, plan: Plan, evaluation: Evaluation) -> str:
    """What the alternative moves or computes for this term, from the cost model's inputs."""
    model = CostModel(problem)
    stages, terms = plan.stages, evaluation.stages
    scale = plan.micro_batch / problem.profile_batch
    micro_batches = problem.global_batch // plan.micro_batch
    latency = f"{fmt(problem.region.request_latency_s * 1e3, 3)} ms per request"
    if name == "compute":
        s = max(
            range(len(stages)),
            key=lambda i: (
                math.ceil(micro_batches / stages[i].replicas)
                * (terms[i].forward_compute_s + terms[i].backward_compute_s)
            ),
        )
        per_replica = math.ceil(micro_batches / stages[s].replicas)
        where = "" if len(stages) == 1 else f" in stage {s}"
        return f"{per_replica} micro-batches per replica{where} on {fmt(model.vcpus(stages[s].tier_mb), 3)} vCPUs"
    if name == "data loading":
        size = scale * problem.blocks[0].input_bytes
        return f"{_size(size)} per micro-batch at {_bandwidth(model, stages[0].tier_mb)}"
    if name == "stage transfers":
        cuts = [scale * problem.blocks[c.last].output_bytes for c in stages[:-1]]
        if not cuts:
            return ""
        rates = sorted({_bandwidth(model, c.tier_mb) for c in stages}, key=lambda text: float(text.split()[0]))
        at = rates[0] if len(rates) == 1 else f"{rates[0]} to {rates[-1]}"
        over = "one cut" if len(cuts) == 1 else f"{len(cuts)} cuts"
        return (
            f"{_size(sum(cuts))} of activations per micro-batch over {over}, and their gradients back, "
            f"at {at} and {latency}"
        )
    if name == "gradient sync":
        s = max(range(len(stages)), key=lambda i: terms[i].sync_s)
        if stages[s].replicas == 1:
            return ""
        where = "" if len(stages) == 1 else f" of stage {s}"
        return (
            f"{_size(terms[s].parameter_bytes)} of gradients{where} scatter-reduced among "
            f"{stages[s].replicas} replicas at {_bandwidth(model, stages[s].tier_mb)} and {latency}"
        )
    if name == "optimizer update":
        s = max(range(len(stages)), key=lambda i: terms[i].update_s)
        state = model.parameter_state_bytes(terms[s].parameter_bytes)
        return f"{_size(state)} of parameters, gradients and optimizer state streamed"
    if name == "invocations":
        functions = sum(c.replicas for c in stages)
        return f"{functions} functions invoked per iteration"
    if name == "storage requests":
        return f"{sum(t.puts for t in terms)} PUTs and {sum(t.gets for t in terms)} GETs per iteration"
    return ""


def _size(size: float) -> str:
    """Bytes in MB (2^20, as the cost model's MB), or KB below one MB."""
    return f"{fmt(size / MB, 3)} MB" if size >= MB else f"{fmt(size / 1024, 3)} KB"


def _bandwidth(model: CostModel, tier_mb: int) -> str:
    return f"{fmt(model.bandwidth(tier_mb) / 1e6, 3)} MB/s"


def function_gb(plan: Plan) -> float:
    """GB of functions the plan keeps alive through an iteration."""
    return sum(c.replicas * c.tier_mb / 1024 for c in plan.stages)


def ties(a: float, b: float) -> bool:
    return abs(a - b) <= TIE * max(abs(a), abs(b))


def ratio(ours: float, theirs: float) -> float | None:
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs <= 0:
        return None
    return ours / theirs
