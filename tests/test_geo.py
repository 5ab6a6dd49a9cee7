"""The inter-region schedule's MILP equals enumeration on seeded random instances, for every
objective and both sync strategies; the closed form charges what the strategies imply."""

from __future__ import annotations

import random

import pytest

from cloudless.compiler import geo
from cloudless.compiler.cost_model import Plan
from cloudless.compiler.geo import (
    GeoInfeasible,
    GeoPlan,
    GeoProblem,
    RegionOption,
    RegionSite,
    enumerate_plans,
    evaluate,
    objective_value,
    solve_geo,
    sync_coefficients,
    within,
)
from cloudless.compiler.solver import Goal, solve_program
from cloudless.ir.catalog import Link


def random_geo_problem(seed: int, sync: str, regions: int | None = None) -> GeoProblem:
    rng = random.Random(seed)
    n = regions or rng.choice([2, 2, 3])
    sites = []
    for r in range(n):
        options = []
        for _ in range(rng.choice([1, 2])):
            tau = rng.uniform(0.5, 5.0)
            options.append(
                RegionOption(
                    plan=Plan(4, ()),
                    iteration_s=tau,
                    compute_usd=tau * rng.uniform(1e-5, 5e-4),
                    fixed_usd=rng.uniform(0, 1e-5),
                    largest_stage_bytes=rng.randint(1, 400) * 2**20,
                    stages=rng.randint(1, 3),
                )
            )
        sites.append(
            RegionSite(
                name=f"region-{r}",
                data=rng.choice([0, 1000, 3000, 8000]) if r else rng.choice([1000, 5000]),
                options=tuple(options),
                egress_usd_per_gb=rng.choice([0.01, 0.02, 0.09]),
                put_usd=5e-6,
                get_usd=4e-7,
                local=Link(rng.uniform(50e6, 90e6), 0.02),
            )
        )
    links = {
        frozenset((a.name, b.name)): Link(rng.uniform(20e6, 150e6), rng.uniform(0.01, 0.2))
        for i, a in enumerate(sites)
        for b in sites[i + 1 :]
    }
    return GeoProblem(
        sites=tuple(sites),
        links=links,
        global_batch=64,
        iterations=rng.choice([50, 200, 1000]),
        sync=sync,
        sync_every=rng.choice([5, 20, 100]),
        sample_bytes=rng.choice([3e3, 6e5]),
        parts=2,
    )


def brute_force(problem: GeoProblem, objective: str, deadline=None, budget=None):
    best = None
    for plan in enumerate_plans(problem):
        evaluation = evaluate(problem, plan)
        if not within(evaluation, deadline, budget):
            continue
        key = objective_value(objective, evaluation)
        if best is None or key < best[0]:
            best = (key, plan, evaluation)
    return best


@pytest.mark.parametrize("sync", [pytest.param("asgd-ga", marks=pytest.mark.slow), "model-average"])
def test_geo_milp_matches_enumeration(sync: str) -> None:
    for seed in range(12):
        problem = random_geo_problem(seed, sync)
        cheapest = brute_force(problem, "cost")
        fastest = brute_force(problem, "time")
        assert cheapest is not None and fastest is not None
        rng = random.Random(seed)
        limits = {
            "cost": {},
            "time": {},
            "cost-under-deadline": {"deadline": fastest[2].training_s * rng.uniform(1.0, 1.5)},
            "time-under-budget": {"budget": cheapest[2].cost_usd * rng.uniform(1.0, 1.5)},
        }
        for objective, kwargs in limits.items():
            expected = brute_force(problem, objective, **kwargs)
            assert expected is not None
            got = solve_geo(problem, objective, **kwargs)
            want = expected[0][0]
            have = objective_value(objective, got.evaluation)[0]
            assert have == pytest.approx(want, rel=1e-6, abs=1e-12), (seed, objective, expected[1], got.plan)
            assert got.status == "optimal"


def test_baseline_restrictions_are_never_better_than_the_joint_schedule() -> None:
    for seed in range(6):
        problem = random_geo_problem(seed, "asgd-ga", regions=2)
        joint = solve_geo(problem, "cost")
        local = solve_geo(problem, "cost", allow_moves=False)
        assert joint.evaluation.cost_usd <= local.evaluation.cost_usd * (1 + 1e-9)
        for r in range(2):
            single = solve_geo(problem, "cost", only=[r])
            assert joint.evaluation.cost_usd <= single.evaluation.cost_usd * (1 + 1e-9)
            assert [o is not None for o in single.plan.options] == [i == r for i in range(2)]


def test_model_average_keeps_every_region_alive_until_the_slowest_ends() -> None:
    problem = random_geo_problem(3, "model-average", regions=2)
    sites = problem.sites
    plan = GeoPlan((0, 0))
    if not sites[1].data:
        plan = GeoPlan((0, 0), (((0, 1), 1),))
    evaluation = evaluate(problem, plan)
    assert evaluation.feasible
    figures = [f for f in evaluation.regions if f is not None]
    assert all(f.alive_s == evaluation.training_s for f in figures)
    assert all(f.sync_s > 0 for f in figures)
    asgd = evaluate(GeoProblem(**{**problem.__dict__, "sync": "asgd-ga"}), GeoPlan(plan.options, plan.moves, 0))
    assert min(f.alive_s for f in asgd.regions if f is not None) < asgd.training_s


def test_infeasible_deadline_is_an_error() -> None:
    problem = random_geo_problem(1, "asgd-ga")
    with pytest.raises(GeoInfeasible):
        solve_geo(problem, "cost-under-deadline", deadline=1e-6)


@pytest.mark.parametrize("sync", ["asgd-ga", "model-average"])
def test_milp_value_is_the_closed_form_of_its_plan(sync: str) -> None:
    """The MILP's optimum is the closed form's value of the plan it returns, for every server: its
    sync terms are the closed form's (sync_coefficients), not a second derivation."""
    checked = 0
    for seed in range(10):
        problem = random_geo_problem(seed, sync)
        servers = range(len(problem.sites)) if sync == "asgd-ga" else [None]
        for objective in ("cost", "time"):
            for server in servers:
                allowed = set(range(len(problem.sites)))
                plan, status, value, _ = geo._solve_one(problem, Goal(objective), server, None, True, allowed)
                if plan is None:
                    assert status == "infeasible"
                    continue
                assert status == "optimal"
                evaluation = evaluate(problem, plan)
                assert evaluation.feasible
                assert value == pytest.approx(objective_value(objective, evaluation)[0], rel=1e-6), (seed, server)
                checked += 1
    assert checked >= 20


def test_sync_coefficients_charge_each_other_region() -> None:
    """Model averaging reads every other training region's model; ASGD-GA pays one round trip to the
    server, whatever else trains."""
    problem = random_geo_problem(2, "model-average", regions=3)
    option = problem.sites[0].options[0]
    terms = sync_coefficients(problem, 0, option, None)
    assert set(terms.each) == {1, 2}
    seconds, egress, requests = terms.per_round([1, 2])
    assert seconds == pytest.approx(
        problem.sites[0].local.transfer_s(option.largest_stage_bytes)
        + sum(problem.link("region-0", f"region-{b}").transfer_s(option.largest_stage_bytes) for b in (1, 2))
    )
    gb = option.largest_stage_bytes * option.stages / 1e9
    assert egress == pytest.approx(gb * (problem.sites[1].egress_usd_per_gb + problem.sites[2].egress_usd_per_gb))
    assert requests == pytest.approx(option.stages * (problem.sites[0].put_usd + 2 * problem.sites[0].get_usd))
    assert terms.per_round([]) == (0.0, 0.0, 0.0)
    asgd = GeoProblem(**{**problem.__dict__, "sync": "asgd-ga"})
    one, two = (sync_coefficients(asgd, 0, option, 1).per_round(others) for others in ([1], [1, 2]))
    round_trip = 2 * asgd.link("region-0", "region-1").transfer_s(option.largest_stage_bytes)
    assert one == two and one[0] == pytest.approx(round_trip)


@pytest.mark.parametrize("sync", ["asgd-ga", "model-average"])
def test_geo_milp_with_cbc_matches_enumeration(sync: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same program through the adapter's CBC path (when highspy is missing) finds the optimum."""
    monkeypatch.setattr(geo, "solve_program", lambda program, limit: solve_program(program, limit, backend="CBC"))
    for seed in range(3):
        problem = random_geo_problem(seed, sync)
        for objective in ("cost", "time"):
            expected = brute_force(problem, objective)
            got = solve_geo(problem, objective)
            assert got.solver == "CBC" and got.status == "optimal"
            have = objective_value(objective, got.evaluation)[0]
            assert have == pytest.approx(expected[0][0], rel=1e-6, abs=1e-12), (seed, objective)
