"""The inter-region schedule's MILP equals enumeration on seeded random instances, for every
objective and both sync strategies; the closed form charges what the strategies imply."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cloudless.compiler.planner import geo
from cloudless.compiler.planner.cost_model import Plan
from cloudless.compiler.planner.geo import (
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
from cloudless.compiler.planner.solver import Goal, solve_program
from cloudless.ir.catalog import Link
from cloudless.ir.deployment import peer_parameter

from .conftest import SAMPLES


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


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["asgd-ga", "model-average"])
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


# --- issue 18: sync, residency, capacity, one-way moves, plan = run -----------------------------------------


def _with(problem: GeoProblem, **changes: object) -> GeoProblem:
    return GeoProblem(**{**problem.__dict__, **changes})


def _site(problem: GeoProblem, r: int, **changes: object) -> GeoProblem:
    sites = list(problem.sites)
    sites[r] = RegionSite(**{**sites[r].__dict__, **changes})
    return _with(problem, sites=tuple(sites))


def _two_regions(seed: int, sync: str) -> GeoProblem:
    """A random problem of two regions that both hold data."""
    problem = random_geo_problem(seed, sync, regions=2)
    if not problem.sites[1].data:
        problem = _site(problem, 1, data=3000)
    return problem


@pytest.mark.parametrize("seed", range(6))
def test_sync_milp_matches_enumeration_and_meets_every_iteration(seed: int) -> None:
    problem = _two_regions(seed, "sync")
    assert problem.rounds == problem.iterations
    for objective in ("cost", "time"):
        expected = brute_force(problem, objective)
        got = solve_geo(problem, objective)
        have = objective_value(objective, got.evaluation)[0]
        assert have == pytest.approx(expected[0][0], rel=1e-6, abs=1e-12), (seed, objective, expected[1], got.plan)
    both = evaluate(problem, GeoPlan((0, 0)))
    assert both.feasible
    figures = [f for f in both.regions if f is not None]
    # every region runs every iteration, meets every one, and waits at the barrier
    assert all(f.iterations == problem.iterations and f.alive_s == both.training_s for f in figures)
    shares = geo.region_shares(problem, GeoPlan((0, 0)))
    assert [s.iterations for s in shares] == [problem.iterations] * 2
    assert sum(s.weight for s in shares) == pytest.approx(1.0)


def test_sync_charges_every_iteration_what_model_averaging_charges_a_round() -> None:
    problem = _two_regions(1, "sync")
    averaged = _with(problem, sync="model-average")
    option = problem.sites[0].options[0]
    assert sync_coefficients(problem, 0, option, None).per_round([1]) == sync_coefficients(
        averaged, 0, option, None
    ).per_round([1])
    plan = GeoPlan((0, 0))
    assert evaluate(problem, plan).regions[0].sync_s == pytest.approx(
        evaluate(averaged, plan).regions[0].sync_s * problem.iterations / averaged.rounds
    )


@pytest.mark.parametrize("seed", range(8))
def test_residency_is_respected_and_matches_enumeration(seed: int) -> None:
    problem = _site(_two_regions(seed, "model-average"), 1, may_move_to=frozenset())
    for objective in ("cost", "time"):
        got = solve_geo(problem, objective)
        assert all(a != 1 for (a, _), _ in got.plan.moves), got.plan  # region-1's data stays
        assert got.plan.options[1] is not None  # so region-1 trains
        expected = brute_force(problem, objective)
        have = objective_value(objective, got.evaluation)[0]
        assert have == pytest.approx(expected[0][0], rel=1e-6, abs=1e-12)
    with pytest.raises(GeoInfeasible):
        solve_geo(problem, "cost", only=[0])  # all data in region-0 would move region-1's
    moved = evaluate(problem, GeoPlan((0, 0), (((1, 0), 1),)))
    assert any("may not move" in v for v in moved.violations)


def test_capacity_binding_changes_the_plan() -> None:
    base = _two_regions(0, "asgd-ga")
    fast = RegionOption(Plan(4, ()), 0.1, 0.1 * 1e-4, 0.0, 2**20, 1, functions=8, memory_mb=8 * 3008)
    slow = RegionOption(Plan(4, ()), 1.0, 1.0 * 1e-5, 0.0, 2**20, 1, functions=1, memory_mb=3008)
    problem = _site(base, 0, options=(fast, slow))
    free = solve_geo(problem, "time")
    assert free.plan.options[0] == 0
    for limit in ({"max_functions": 4}, {"max_memory_mb": 10240}):
        bound = solve_geo(_site(problem, 0, **limit), "time")
        assert bound.plan.options[0] in (1, None), limit  # the fast option no longer fits
        assert bound.evaluation.training_s >= free.evaluation.training_s
    assert not evaluate(_site(problem, 0, max_functions=4), GeoPlan((0, 0), (), 0)).feasible


@pytest.mark.parametrize("sync", ["asgd-ga", "model-average"])
def test_data_moves_one_way_per_pair(sync: str) -> None:
    for seed in range(8):
        problem = _two_regions(seed, sync)
        for objective in ("cost", "time"):
            moves = solve_geo(problem, objective).plan.moves
            pairs = {pair for pair, parts in moves if parts}
            assert not any((b, a) in pairs for a, b in pairs), (seed, moves)
    both_ways = evaluate(problem, GeoPlan((0, 0), (((0, 1), 1), ((1, 0), 1)), 0))
    assert any("both ways" in v for v in both_ways.violations)


@pytest.mark.parametrize("sync", ["asgd-ga", "model-average"])
def test_iterations_are_exactly_the_plan_and_rounds_fit_every_region(sync: str) -> None:
    for seed in range(10):
        problem = random_geo_problem(seed, sync)
        for objective in ("cost", "time"):
            solution = solve_geo(problem, objective)
            shares = geo.region_shares(problem, solution.plan)
            assert sum(s.iterations for s in shares) == problem.iterations, (seed, shares)
            assert all(s.iterations >= problem.rounds for s in shares)
            assert sum(s.weight for s in shares) == pytest.approx(1.0)
            if sync == "asgd-ga" and len(shares) > 1:
                assert solution.plan.server in [s.site for s in shares]  # the server trains: it has files


def test_whole_iterations_add_up_and_keep_the_least() -> None:
    assert geo.whole_iterations([140.2, 59.8], 200, 20) == [140, 60]
    assert geo.whole_iterations([66.5, 66.5, 67.0], 200, 1) == [67, 66, 67]
    assert geo.whole_iterations([195.0, 5.0], 200, 10) == [190, 10]


def test_equal_split_trains_every_region_about_equally() -> None:
    problem = _two_regions(2, "model-average")
    solution = solve_geo(problem, "cost", equal_split=True)
    held = [f.data for f in solution.evaluation.regions if f is not None]
    assert len(held) == 2
    part = max(s.data for s in problem.sites) / problem.parts
    assert abs(held[0] - held[1]) <= 2 * part + 1e-6


def test_catalog_residency_and_capacity_errors_name_the_key(tmp_path) -> None:
    import yaml

    from cloudless.ir.catalog import load_catalog
    from cloudless.ir.schema import SchemaError

    sample = yaml.safe_load((SAMPLES / "mlp_digits_geo.yaml").read_text())
    catalog = load_catalog(SAMPLES / "mlp_digits_geo.yaml")
    west = catalog.region("aws-eu-west-1")
    assert west.data_may_move_to == () and west.max_total_memory_mb == 16384 and west.max_functions == 8
    assert catalog.region("aws-us-east-1").data_may_move_to is None
    cases = [
        ({"data_may_move_to": ["aws-ap-south-1"]}, "key regions/1/data_may_move_to/0: no region 'aws-ap-south-1'"),
        ({"data_may_move_to": ["aws-eu-west-1"]}, "key regions/1/data_may_move_to/0: 'aws-eu-west-1' is the region"),
        ({"data_may_move_to": "aws-us-east-1"}, "regions/1/data_may_move_to"),
    ]
    for change, message in cases:
        document = yaml.safe_load(yaml.safe_dump(sample))
        document["regions"][1].update(change)
        path = tmp_path / "catalog.yaml"
        path.write_text(yaml.safe_dump(document))
        with pytest.raises(SchemaError, match=message.replace("(", r"\(")):
            load_catalog(path)
    document = yaml.safe_load(yaml.safe_dump(sample))
    document["regions"][1]["limits"]["max_total_memory_mb"] = 512
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(SchemaError, match="key regions/1/limits/max_total_memory_mb: 512 MB"):
        load_catalog(path)


def test_sync_every_one_without_sync_sync_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from cloudless.compiler.cli import main

    args = [str(SAMPLES / "mlp_digits_geo.py"), "-o", str(tmp_path / "b"), "--regions", "all", "--sync-every", "1"]
    code = main([*args, "-q"])
    assert code == 2
    assert "use --sync sync" in capsys.readouterr().err
    # and sync meets every iteration: another interval is a mistake, not silently ignored
    assert main([*args[:-1], "3", "--sync", "sync", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--sync-every 3 with --sync sync" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


# --- the shipped sample, compiled: several regions deploy one bucket each, the server has its files ---------


@pytest.fixture(scope="module")
def geo_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cloudless.compiler.cli import main

    output = tmp_path_factory.mktemp("geo") / "build"
    profile = Path(__file__).resolve().parent / "golden" / "mlp_digits_geo" / "ir" / "blocks.json"
    timing = ["--profile", str(profile)] if profile.exists() else ["--repeats", "1"]
    args = [str(SAMPLES / "mlp_digits_geo.py"), "-o", str(output), "-q", *timing]
    args += ["-c", str(SAMPLES / "mlp_digits_geo.yaml"), "--regions", "aws-us-east-1,aws-eu-west-1"]
    assert main([*args, "--sync", "asgd-ga"]) == 0
    return output


def test_geo_sample_trains_across_regions_cheaper_than_any_allowed_single_region(geo_build: Path) -> None:
    import json

    plan = json.loads((geo_build / "plan.json").read_text())["regions"]
    assert [s["trains"] for s in plan["sites"]] == [True, True]
    assert plan["moves"] == []  # aws-eu-west-1's data stays; moving aws-us-east-1's there costs more
    baselines = {b["name"]: b for b in plan["baselines"]}
    assert set(baselines) == {
        "data-local",
        "equal-split",
        "single-region:aws-us-east-1",
        "single-region:aws-eu-west-1",
    }
    east = baselines["single-region:aws-us-east-1"]
    assert not east["feasible"] and "data residency" in east["reason"]
    single = baselines["single-region:aws-eu-west-1"]
    assert single["feasible"] and plan["cost_usd"] < 0.9 * single["cost_usd"]
    assert all(b["cost_usd"] >= plan["cost_usd"] * (1 - 1e-9) for b in baselines.values() if b["feasible"])
    assert sum(s["runs_iterations"] for s in plan["sites"]) == 200


def test_geo_build_deploys_one_bucket_per_region_and_the_server_has_files(geo_build: Path) -> None:
    import json

    import yaml

    from cloudless.ir.files import load_workflow

    workflow = load_workflow(geo_build / "workflow.yaml")
    names = [r.name for r in workflow.regions]
    assert workflow.sync.inter_region == "asgd-ga" and workflow.sync.server in names
    assert workflow.sync.staleness_bound == len(names) - 1
    assert sum(r.iterations or 0 for r in workflow.regions) == workflow.run.iterations
    assert all(workflow.sync.rounds <= (r.iterations or 0) for r in workflow.regions)
    assert all(r.prices is not None for r in workflow.regions)
    server = workflow.sync.server
    assert (geo_build / "regions" / server / "template.yaml").is_file()
    assert (geo_build / "regions" / server / "stack.yaml").is_file()
    assert any((geo_build / "regions" / server / "functions").iterdir())
    storage = {}
    for name in names:
        stack = yaml.safe_load((geo_build / "regions" / name / "stack.yaml").read_text())
        for function in stack["functions"].values():
            environment = function["environment"]
            storage[name] = environment["CLOUDLESS_STORAGE"]
            peers = json.loads(environment["CLOUDLESS_PEERS"])
            assert set(peers) == set(names) - {name}
    assert len(set(storage.values())) == len(names)  # one bucket per region
    for name in names:
        stack = yaml.safe_load((geo_build / "regions" / name / "stack.yaml").read_text())
        for function in stack["functions"].values():
            peers = json.loads(function["environment"]["CLOUDLESS_PEERS"])
            assert peers == {peer: storage[peer] for peer in names if peer != name}
        template = yaml.safe_load((geo_build / "regions" / name / "template.yaml").read_text())
        assert "RunBucket" in template["Resources"]
        others = [peer for peer in names if peer != name]
        assert set(template["Parameters"]) == {f"PeerBucket{''.join(p.title() for p in o.split('-'))}" for o in others}
        functions = [r for r in template["Resources"].values() if r["Type"] == "AWS::Serverless::Function"]
        for resource in functions:
            # a peer's rights hold once its bucket is given (Fn::If on HasPeerBucket<Region>)
            statements = resource["Properties"]["Policies"][0]["Statement"]
            sids = {(st["Fn::If"][1] if "Fn::If" in st else st)["Sid"] for st in statements}
            for other in others:
                suffix = peer_parameter(other).removeprefix("PeerBucket")
                assert {f"PeerObjects{suffix}", f"PeerBucketLookups{suffix}"} <= sids
            server_suffix = peer_parameter(server).removeprefix("PeerBucket")
            assert (f"GlobalModelWrites{server_suffix}" in sids) == (name != server)
    report = (geo_build / "report.md").read_text()
    assert "## Between regions" in report and "```mermaid" in report and "ASGD-GA server" in report
