"""Fuzzing (issue 15 item 5): generated region catalogs, command lines and invocation payloads thrown at
the validators and at a function's handler. Every case ends in a clean error (the project's error type,
one line) or a valid result, and a handler never reads or writes outside its run's prefix.

- catalogs: the built-in catalog with generated mutations (a key deleted, a leaf replaced by any JSON
  value, an unknown key added, a region duplicated) through `parse_catalog`; those that parse through
  the planner; catalog text (random bytes, other encodings, deep nesting, alias bombs) through
  `load_catalog`;
- command lines: argument vectors for cloudless-compile and cloudless-run built from their own parsers'
  options, with invalid inputs only (a model file, build or catalog that fails validation): no example
  may compile or run, and a guard fails the example that gets that far;
- payloads: `Invocation.from_json` on generated JSON; then `handle_request` on a compiled sample's
  function with a folder storage, recording every key it touches and every file it changes.

Hypothesis runs derandomized (the same examples on every run); each test has a fast size (the default
run) and a larger one marked slow. A bug found is pinned as a strict xfail test at the end of its section,
and the property tests recognise exactly that failure (`KNOWN`) and go on fuzzing. When a fix lands, its
xfail test passes, which fails as XPASS(strict): then delete the test and its `KNOWN` entry.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import shutil
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, assume, event, example, given, note, settings
from hypothesis import strategies as st

from cloudless.compiler.errors import CompileError
from cloudless.ir.catalog import Catalog, load_catalog, parse_catalog
from cloudless.ir.protocol import MAX_NUMBER, MAX_RUN_BYTES, Invocation, namespace
from cloudless.ir.schema import SchemaError

from .conftest import ROOT, SAMPLES

MLP = SAMPLES / "mlp_digits.py"
GOLDEN_PROFILE = Path(__file__).resolve().parent / "golden" / "mlp_digits" / "ir" / "blocks.json"


def fuzz(examples: int) -> settings:
    """Deterministic (derandomized, no example database) and without a per-example deadline. A fixture
    of the test (capsys, tmp_path) is shared by its examples on purpose: each example resets what it uses."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
    )


def sizes(fast: int, slow: int) -> pytest.MarkDecorator:
    """`examples`: `fast` in the default run, `slow` in the slow (CI) run."""
    return pytest.mark.parametrize(
        "examples", [pytest.param(fast, id="fast"), pytest.param(slow, id="slow", marks=pytest.mark.slow)]
    )


def assert_one_line(message: str, starts: str = "") -> None:
    lines = message.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"not one line: {message!r}"
    assert message.startswith(starts), f"does not start with {starts!r}: {message!r}"


# --- known findings ----------------------------------------------------------------------------------


def raised_in(exc: BaseException, path: str) -> bool:
    """Whether a frame of `exc`'s traceback is in the repository file `path` (like "ir/schema.py")."""
    return any(Path(f.filename).as_posix().endswith(path) for f in traceback.extract_tb(exc.__traceback__))


@dataclass(frozen=True)
class Known:
    """A bug the fuzzing found, pinned by a strict xfail test: `test` names it."""

    test: str
    matches: Callable[[BaseException], bool]


KNOWN: tuple[Known, ...] = ()


def known_issue(exc: BaseException) -> str | None:
    """The xfail test of the known bug `exc` is, if it is one."""
    return next((k.test for k in KNOWN if k.matches(exc)), None)


def known_or_raise(exc: BaseException) -> None:
    """Note a known bug as the example's `event`; re-raise anything else. (A retried invocation of a
    huge range is not here: it never ends, so the handler test leaves those payloads out beforehand.)"""
    known = known_issue(exc)
    if known is None:
        raise exc
    event(f"known bug: {known}")


# ======================================================================================================
# 1. Region catalogs
# ======================================================================================================

CATALOG_FILE = ROOT / "ir" / "catalogs" / "default.yaml"
SOURCE = "fuzz.yaml"


@functools.cache
def default_catalog_text() -> str:
    return CATALOG_FILE.read_text()


@functools.cache
def _default_catalog() -> Any:
    return yaml.safe_load(default_catalog_text())


def default_catalog() -> Any:
    """A fresh copy of the built-in catalog as parsed YAML (its keys are whatever the file says)."""
    return copy.deepcopy(_default_catalog())


SPECIAL_INTS = [0, 1, -1, 127, 128, 1024, 10240, 10241, 2**31, 2**53 + 1, 2**63, 2**64, 10**30, -(10**30), 10**400]
SPECIAL_FLOATS = [0.0, -0.0, 0.5, 1e-300, 1e-308, 5e-324, 1e308, -1e308, math.inf, -math.inf, math.nan]
SPECIAL_TEXT = ["", " ", "aws", "openfaas", "aws-us-east-1", "aws-eu-west-1", "aws-us-west-2", "gcp-x", "é", "区域"]
SPECIAL_TEXT += ["a" * 300, "\x00", "a\nb", "\u2028", "1e400", "null", "../x", "-a", "A"]
ints = st.integers() | st.sampled_from(SPECIAL_INTS)
floats = st.floats() | st.sampled_from(SPECIAL_FLOATS)
numbers = ints | floats
texts = st.text(max_size=16) | st.sampled_from(SPECIAL_TEXT)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)
#: numbers a catalog's schema may accept, extremes included: for catalogs that reach the planner
plausible_numbers = (
    st.integers(1, 10**6)
    | st.floats(1e-6, 1e6)
    | st.sampled_from([0, 0.0, 1e-308, 5e-324, 1e-9, 128, 129, 10240, 1e9, 1e308, 2**53 + 1, 2**63, 10**30])
)
#: other AWS region names, so that a duplicated region can stay valid
region_names = st.sampled_from(["aws-us-west-2", "aws-eu-central-1", "aws-ap-south-1", "aws-us-east-1"])

Key = str | int


def walk(doc: Any, prefix: tuple[Key, ...] = ()) -> Iterator[tuple[tuple[Key, ...], Any]]:
    """Every (path, value) below `doc`, containers and leaves, parents first."""
    children: Any = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in children:
        path = (*prefix, key)
        yield path, value
        yield from walk(value, path)


def locate(doc: Any, path: tuple[Key, ...]) -> tuple[Any, Key]:
    """The container holding `path`'s node, and its key there."""
    for key in path[:-1]:
        doc = doc[key]
    return doc, path[-1]


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


MUTATIONS = ("delete", "replace", "number", "unknown-key", "duplicate-region", "wan-link", "whole")
#: mostly catalogs that still parse, with extreme figures
PLANNING_MUTATIONS = ("number", "number", "number", "number", "duplicate-region", "wan-link", "delete")


@st.composite
def mutated_catalogs(
    draw: st.DrawFn,
    kinds: Sequence[str] = MUTATIONS,
    values: st.SearchStrategy[Any] = json_values,
    number_values: st.SearchStrategy[Any] = numbers,
    most: int = 4,
) -> Any:
    """The built-in catalog after 1..`most` mutations, found by walking it (no key is spelled here)."""
    doc = default_catalog()
    log: list[str] = []
    for _ in range(draw(st.integers(1, most))):
        kind = draw(st.sampled_from(kinds))
        nodes = list(walk(doc))
        if kind == "delete" and nodes:
            path, _ = draw(st.sampled_from(nodes))
            parent, key = locate(doc, path)
            del parent[key]
            log.append(f"delete {path}")
        elif kind == "replace" and nodes:
            path, _ = draw(st.sampled_from(nodes))
            parent, key = locate(doc, path)
            parent[key] = draw(values)
            log.append(f"replace {path} = {parent[key]!r}")
        elif kind == "number":
            leaves = [path for path, value in nodes if is_number(value)]
            if leaves:
                path = draw(st.sampled_from(leaves))
                parent, key = locate(doc, path)
                parent[key] = draw(number_values)
                log.append(f"number {path} = {parent[key]!r}")
        elif kind == "unknown-key":
            containers = [()] + [path for path, value in nodes if isinstance(value, dict)]
            path = draw(st.sampled_from(containers))
            container = doc
            for key in path:
                container = container[key]
            if isinstance(container, dict):
                name = draw(texts)
                container[name] = draw(values)
                log.append(f"add {(*path, name)} = {container[name]!r}")
        elif kind == "duplicate-region":
            regions = doc.get("regions") if isinstance(doc, dict) else None
            if isinstance(regions, list) and regions:
                region = copy.deepcopy(draw(st.sampled_from(regions)))
                if isinstance(region, dict) and draw(st.booleans()):
                    region["name"] = draw(region_names)
                regions.append(region)
                log.append(f"duplicate a region as {region.get('name') if isinstance(region, dict) else region!r}")
        elif kind == "wan-link":  # a link between two regions, shaped like the wan default (its keys)
            wan = doc.get("wan") if isinstance(doc, dict) else None
            regions = doc.get("regions") if isinstance(doc, dict) else None
            if isinstance(wan, dict) and isinstance(wan.get("default"), dict) and isinstance(regions, list):
                names = [r.get("name") for r in regions if isinstance(r, dict)]
                link = copy.deepcopy(wan["default"])
                link["between"] = draw(st.lists(st.sampled_from(names or ["x"]), min_size=2, max_size=2))
                figures = sorted(str(k) for k in link if k != "between")
                if figures:
                    link[draw(st.sampled_from(figures))] = draw(number_values)
                links = wan.setdefault("links", [])
                if isinstance(links, list):
                    links.append(link)
                log.append(f"wan link {link}")
        elif kind == "whole":
            doc = draw(values)
            log.append(f"whole = {doc!r}")
    note(f"mutations: {log}")
    return doc


def parse_or_schema_error(doc: Any) -> Catalog | None:
    """The catalog, or None after checking the error is a one-line SchemaError naming the source."""
    try:
        catalog = parse_catalog(doc, SOURCE)
    except SchemaError as exc:
        if known_issue(exc) is None:
            assert_one_line(str(exc), SOURCE)
            event("catalog: SchemaError")
        else:
            known_or_raise(exc)
        return None
    except Exception as exc:  # noqa: BLE001 - the contract is SchemaError and nothing else
        known_or_raise(exc)
        return None
    assert isinstance(catalog, Catalog) and catalog.regions
    event("catalog: parsed")
    return catalog


@sizes(300, 2500)
def test_mutated_catalogs_parse_or_fail_with_one_line(examples: int) -> None:
    @fuzz(examples)
    @given(mutated_catalogs())
    def check(doc: Any) -> None:
        parse_or_schema_error(doc)

    check()


# --- catalogs that parse, through the planner --------------------------------------------------------

OBJECTIVES = ("cost", "time", "cost-under-deadline", "time-under-budget")
PLAN_TIME_LIMIT_S = 2.0
limits = st.none() | st.sampled_from([0.0, -1.0, math.nan, math.inf, 1e-300, 1e-3, 1.0, 1e3, 1e9, 1e300])


@pytest.fixture(scope="module")
def planning_inputs() -> tuple[Any, Any]:
    """The MLP sample's saved block profile (no tracing, no timing) and its model file."""
    from cloudless.compiler.frontend.model_file import load_model_file
    from cloudless.ir import BlockChain

    return BlockChain.load(GOLDEN_PROFILE), load_model_file(MLP)


def plan_or_compile_error(chain: Any, model_file: Any, catalog: Catalog, options: Any) -> None:
    """The planning pass on `catalog`: a feasible plan with finite figures, or one CompileError line."""
    from cloudless.compiler.planner.plan import plan_training
    from cloudless.compiler.planner.simulate import simulate

    with mock.patch("cloudless.compiler.planner.plan.load_catalog", return_value=catalog):
        try:
            planned = plan_training(chain, model_file, options)
        except CompileError as exc:
            assert_one_line(str(exc))
            event(f"plan: {type(exc).__name__}")
            return
    event("plan: found")
    evaluation = planned.solution.evaluation
    assert evaluation.feasible, evaluation
    assert math.isfinite(evaluation.iteration_s) and evaluation.iteration_s > 0, evaluation
    assert math.isfinite(evaluation.cost_usd) and evaluation.cost_usd >= 0, evaluation
    timeline = simulate(planned.problem, planned.solution.plan)
    assert math.isfinite(timeline.iteration_s) and timeline.iteration_s > 0


@sizes(12, 200)
def test_catalogs_that_parse_plan_or_fail_with_one_line(examples: int, planning_inputs: tuple[Any, Any]) -> None:
    from cloudless.compiler.planner.plan import PlanOptions

    chain, model_file = planning_inputs

    @fuzz(examples)
    @given(
        doc=mutated_catalogs(kinds=PLANNING_MUTATIONS, number_values=plausible_numbers, most=3),
        region=st.integers(0, 7),
        objective=st.sampled_from(OBJECTIVES),
        limit=limits,
        schedule=st.sampled_from(["gpipe", "1f1b"]),
    )
    @example(doc=default_catalog(), region=0, objective="cost", limit=None, schedule="gpipe")
    @example(doc=default_catalog(), region=1, objective="time-under-budget", limit=1e-300, schedule="1f1b")
    def check(doc: Any, region: int, objective: str, limit: float | None, schedule: str) -> None:
        catalog = parse_or_schema_error(doc)
        assume(catalog is not None)  # the parse test covers the rest: here every example plans
        assert catalog is not None
        options = PlanOptions(
            region=catalog.regions[region % len(catalog.regions)].name,
            objective=objective,  # type: ignore[arg-type]
            deadline=limit if objective == "cost-under-deadline" else None,
            budget=limit if objective == "time-under-budget" else None,
            schedule=schedule,  # type: ignore[arg-type]
            time_limit=PLAN_TIME_LIMIT_S,
        )
        try:
            plan_or_compile_error(chain, model_file, catalog, options)
        except Exception as exc:  # noqa: BLE001 - anything but a plan or a CompileError is a finding
            known_or_raise(exc)

    check()


@sizes(4, 80)
def test_catalogs_that_parse_plan_across_regions_or_fail_with_one_line(
    examples: int, planning_inputs: tuple[Any, Any]
) -> None:
    """Two regions of a fuzzed catalog: the inter-region schedule (compiler/planner/geo.py) with either sync."""
    from cloudless.compiler.planner.plan import PlanOptions, plan_training

    chain, model_file = planning_inputs

    @fuzz(examples)
    @given(
        doc=mutated_catalogs(kinds=PLANNING_MUTATIONS, number_values=plausible_numbers, most=3),
        objective=st.sampled_from(OBJECTIVES),
        limit=limits,
        sync=st.sampled_from(["asgd-ga", "model-average"]),
    )
    @example(doc=default_catalog(), objective="cost", limit=None, sync="asgd-ga")
    def check(doc: Any, objective: str, limit: float | None, sync: str) -> None:
        catalog = parse_or_schema_error(doc)
        assume(catalog is not None and len(catalog.regions) >= 2)
        assert catalog is not None
        options = PlanOptions(
            regions=tuple(r.name for r in catalog.regions[:2]),
            sync=sync,  # type: ignore[arg-type]
            objective=objective,  # type: ignore[arg-type]
            deadline=limit if objective == "cost-under-deadline" else None,
            budget=limit if objective == "time-under-budget" else None,
            time_limit=PLAN_TIME_LIMIT_S,
        )
        with mock.patch("cloudless.compiler.planner.plan.load_catalog", return_value=catalog):
            try:
                planned = plan_training(chain, model_file, options)
            except CompileError as exc:
                assert_one_line(str(exc))
                event(f"geo plan: {type(exc).__name__}")
                return
            except Exception as exc:  # noqa: BLE001 - anything but a plan or a CompileError is a finding
                known_or_raise(exc)
                return
        event("geo plan: found")
        assert planned.geo is not None
        evaluation = planned.geo.solution.evaluation
        assert evaluation.feasible, evaluation
        assert math.isfinite(evaluation.training_s) and evaluation.training_s > 0, evaluation
        assert math.isfinite(evaluation.cost_usd) and evaluation.cost_usd >= 0, evaluation

    check()


# --- catalog text through load_catalog -----------------------------------------------------------------

YAML_SNIPPETS = [
    "\nx: " + "9" * 5000,  # an integer of more digits than Python converts
    "\n\x00",
    "\n\x1b[31m",
    "\ufeff",
    "\n  - &a [1, 2]\n  - *a",
    "\n!!python/object/apply:os.system [ls]",
    "\nkey: !!binary aGVsbG8=",
    "\n? [a, b]\n: 1",
    "\n<<: {apiVersion: x}",
    "\nregions: 2001-12-14",
    "\n\t",
    "\n'",
    "\n---\n---",
    "\n%YAML 1.1",
]
NESTINGS = [("[", "]"), ("{a: ", "}"), ("- ", "")]


def alias_bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def nested(depth: int, opener: str, closer: str) -> str:
    if opener == "- ":  # block style: one more indentation per level
        return "regions:\n" + "".join(f"{'  ' * i}- \n" for i in range(depth)) + f"{'  ' * depth}- 1\n"
    return "regions: " + opener * depth + "1" + closer * depth + "\n"


@st.composite
def catalog_texts(draw: st.DrawFn) -> bytes:
    base = default_catalog_text()
    kind = draw(st.sampled_from(["bytes", "text", "splice", "truncate", "deep", "bomb", "encoding", "flip"]))
    event(f"text: {kind}")
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "text":
        return draw(st.text(max_size=300)).encode("utf-8", "surrogatepass")
    if kind == "splice":
        at = draw(st.integers(0, len(base)))
        insert = draw(st.sampled_from(YAML_SNIPPETS) | st.text(max_size=20))
        return (base[:at] + insert + base[at:]).encode("utf-8", "surrogatepass")
    if kind == "truncate":
        return base[: draw(st.integers(0, len(base)))].encode()
    if kind == "deep":
        opener, closer = draw(st.sampled_from(NESTINGS))
        # PyYAML scans deep sequences in quadratic time (1000 levels of "[": 1.6 s, 10000: 25 s); mappings
        # are fast, and deep enough for the recursion limit
        most = 10_000 if opener == "{a: " else 400
        depth = draw(st.sampled_from([10, 100, 300, most]) | st.integers(1, 400))
        return nested(depth, opener, closer).encode()
    if kind == "bomb":
        return (base + alias_bomb(draw(st.integers(1, 9)))).encode()
    if kind == "encoding":
        text = base.replace("assumption", draw(st.sampled_from(["hypothèse", "假设", "Annahme"])))
        return text.encode(draw(st.sampled_from(["utf-16", "utf-32", "latin-1", "utf-8-sig", "gb18030"])), "replace")
    data = bytearray(base.encode())  # flip: a few bytes replaced
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@sizes(120, 1500)
def test_catalog_text_loads_or_fails_with_one_line(examples: int, tmp_path: Path) -> None:
    path = tmp_path / "cloud.yaml"

    @fuzz(examples)
    @given(catalog_texts())
    @example(nested(10_000, "{a: ", "}").encode())
    @example(alias_bomb(9).encode())
    @example(b"\xff\xfe\x00garbage\x80")
    def check(text: bytes) -> None:
        path.write_bytes(text)
        try:
            load_catalog(path)
        except SchemaError as exc:
            if known_issue(exc) is None:
                assert_one_line(str(exc), str(path))
            else:
                known_or_raise(exc)
        except Exception as exc:  # noqa: BLE001 - the contract is SchemaError and nothing else
            known_or_raise(exc)

    check()


# --- catalog bugs the fuzzing found (fixed) ---------------------------------------------------------


def test_deeply_nested_yaml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "cloud.yaml"
    path.write_text(nested(5000, "{a: ", "}"))  # 25 kB
    with pytest.raises(SchemaError) as info:
        load_catalog(path)
    assert_one_line(str(info.value), str(path))


def test_a_yaml_reader_error_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "cloud.yaml"
    path.write_text("apiVersion: cloudless/v1\x00\n")
    with pytest.raises(SchemaError) as info:
        load_catalog(path)
    assert_one_line(str(info.value), str(path))


def test_a_yaml_integer_of_5000_digits_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "cloud.yaml"
    path.write_text(default_catalog_text() + "\nx: " + "9" * 5000 + "\n")
    with pytest.raises(SchemaError) as info:
        load_catalog(path)
    assert_one_line(str(info.value), str(path))


def _set_first(doc: Any, key: str, value: Any) -> Any:
    """`doc` with the first `key` found while walking it set to `value`."""
    path = next(p for p, _ in walk(doc) if p[-1] == key)
    parent, last = locate(doc, path)
    parent[last] = value
    return doc


@pytest.mark.parametrize("where", ["timeout", "wan"])
def test_a_catalog_number_beyond_a_float_is_one_line(where: str) -> None:
    """An integer beyond a float's range (YAML reads plain digits as an int): a SchemaError naming the
    key, never an OverflowError (a region's timeout_s is formatted with :g; the wan link's bandwidth is
    multiplied by 1e6)."""
    doc = default_catalog()
    if where == "timeout":
        _set_first(doc, "timeout_s", 10**400)
    else:
        link = doc["wan"]["default"]
        link[next(k for k in link if k != "latency_s")] = 10**400
    with pytest.raises(SchemaError) as info:
        parse_catalog(doc, SOURCE)
    assert_one_line(str(info.value), SOURCE)


# ======================================================================================================
# 2. Command lines
# ======================================================================================================


class CommandStarted(BaseException):
    """Raised by the guard where a real compile or run would begin: an example got past validation, so
    the strategy generated a valid command line (it must not: each example is to fail fast)."""


@pytest.fixture(scope="module")
def mlp_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """samples/mlp_digits.py compiled with its saved profile (no timing): one function, one replica."""
    from cloudless.compiler.cli import main

    build = tmp_path_factory.mktemp("fuzz-build") / "build"
    timing = ["--profile", str(GOLDEN_PROFILE)] if GOLDEN_PROFILE.exists() else ["--repeats", "1"]
    assert main([str(MLP), "-o", str(build), "-q", *timing]) == 0
    return build


@pytest.fixture(scope="module")
def cli_sandbox(tmp_path_factory: pytest.TempPathFactory, mlp_build: Path) -> Path:
    """A folder of invalid inputs: model files that fail to load, catalogs, builds that are no builds."""
    root = tmp_path_factory.mktemp("cli-sandbox")
    files = {
        "bad.py": b"def build_model(:\n",
        "contract.py": b"X = 1\n",  # Python, but no build_model
        "binary.py": b"\xff\xfe\x00not utf-8\n",
        "notes.txt": b"mine\n",
        "junk/notes.txt": b"mine\n",
        "junk/workflow.yaml": b"regions: [\n",
        "cloud.yaml": default_catalog_text().encode(),
        "broken.yaml": b"regions: [\n",
        "binary.yaml": b"\xff\xfe\x00",
        "blocks.json": b"{}\n",
        "token": b"a-token\n",
        "badflow/workflow.yaml": b"apiVersion: cloudless/v1\nkind: Workflow\n",
        "nopkg/workflow.yaml": (mlp_build / "workflow.yaml").read_bytes(),  # a workflow, no packages
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (root / "folder").mkdir()
    return root


def listing(folder: Path) -> dict[str, tuple[int, int] | None]:
    """Every entry under `folder` but bytecode caches: files as (size, mtime), folders as None."""
    entries: dict[str, tuple[int, int] | None] = {}
    for path in sorted(folder.rglob("*")):
        if "__pycache__" in path.parts:
            continue
        stat = path.stat()
        entries[path.relative_to(folder).as_posix()] = None if path.is_dir() else (stat.st_size, stat.st_mtime_ns)
    return entries


MODEL_PATHS = ["nowhere.py", "bad.py", "contract.py", "binary.py", "notes.txt", "folder", "junk", ".", ""]
MODEL_PATHS += ["nowhere/model.py", "notes.txt/model.py", "cloud.yaml"]
OUTPUT_PATHS = ["out", "out/deeper", "junk", "notes.txt", "folder", ".", "", "notes.txt/out", "nopkg", "/"]
BUILD_PATHS = ["nopkg", "badflow", "junk", "folder", "notes.txt", "nowhere", ".", "", "cloud.yaml"]
OTHER_PATHS = ["cloud.yaml", "broken.yaml", "binary.yaml", "blocks.json", "token", "nowhere.yaml", "folder"]
ANY_PATH = st.sampled_from(sorted(set(MODEL_PATHS + OUTPUT_PATHS + BUILD_PATHS + OTHER_PATHS)))
#: option values: printable, one line, never taken for an option (argparse reads "-x..." as one)
free_text = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=12).filter(
    lambda s: not s.startswith("-")
)
int_text = (
    st.integers(-3, 3).map(str)
    | st.integers().map(str)
    | st.sampled_from(["0", "-1", "99999999999999999999999", "nan", "inf", "1.5", "", "x", "1e3", "٣", "0x10", " 7"])
)
float_text = st.floats().map(repr) | st.sampled_from(
    ["0", "-0", "-1", "nan", "NaN", "inf", "-inf", "1e309", "1e-320", "", "x", "0x10", "1_0", " 2 "]
)
SPECIAL_VALUES: dict[str, list[str]] = {
    "replicas": ["1,2,4,8", "0", "-1", "1,,2", ",", "a", "1e3", "99999999999999999999", "nan", "2,2", " 1 , 2 "],
    "regions": ["all", "aws-us-east-1", "aws-eu-west-1,aws-us-east-1", "nowhere", ",", "all,aws-us-east-1"],
    "region": ["aws-us-east-1", "aws-eu-west-1", "nowhere", ""],
    "storage": ["s3://", "redis://127.0.0.1:1/0", "nowhere-storage", "ftp://x", "folder"],
    "gateway": ["http://127.0.0.1:1", "not a url", ""],
}
#: unknown options and option-like tokens (never a prefix of --help: argparse would print help, exit 0)
UNKNOWN = ["--bogus", "-Z", "--", "---", "-", "--verify=yes", "-qq", "--o", "--re", "--s", "--output-folder", "-0x"]


def path_kind(action: argparse.Action) -> list[str]:
    return {"output": OUTPUT_PATHS, "check": BUILD_PATHS, "model": MODEL_PATHS, "build": BUILD_PATHS}.get(
        action.dest, []
    )


#: values argparse converts: the commands' own validation must refuse the bad ones
parsable_ints = st.integers(-3, 3).map(str) | st.integers().map(str) | st.sampled_from(["99999999999999999999", "٣"])
parsable_floats = st.floats().map(repr) | st.sampled_from(["0", "-0", "1e309", "-1e309", "1e-320", "NaN", "1_0", " 2 "])


def values_of(action: argparse.Action, parsable: bool) -> st.SearchStrategy[str]:
    """Generated values for an option, from its argparse definition; `parsable`: only values argparse
    accepts (a choice, a number of the option's type), so that the command's own checks are reached."""
    if action.choices is not None:
        choices = st.sampled_from(sorted(str(c) for c in action.choices))
        return choices if parsable else choices | free_text
    if action.type is int:
        return parsable_ints if parsable else int_text
    if action.type is float:
        return parsable_floats if parsable else float_text
    if action.type is Path:
        pool = path_kind(action)
        return st.sampled_from(pool) if pool else ANY_PATH
    return st.sampled_from(SPECIAL_VALUES.get(action.dest, ["x"])) | free_text


def option_tokens(flag: str, value: str) -> list[str]:
    """`flag value`, joined when the value looks like an option (argparse would take it for one)."""
    if not value.startswith("-"):
        return [flag, value]
    return [f"{flag}={value}"] if flag.startswith("--") else [f"{flag}{value}"]


@st.composite
def command_lines(
    draw: st.DrawFn,
    parser: argparse.ArgumentParser,
    positional: st.SearchStrategy[str],
    required: Sequence[tuple[str, st.SearchStrategy[str]]] = (),
) -> list[str]:
    """An argument vector from `parser`'s own options (no help). Mostly one argparse accepts (values
    of each option's type, the positional and `required` options there), so that the command's own
    validation runs; else anything: values of any kind, missing values, unknown options."""
    options = [
        a
        for a in parser._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction | argparse._VersionAction)
    ]
    parsable = draw(st.integers(0, 3)) > 0
    parts: list[list[str]] = []
    if parsable:
        parts += [option_tokens(flag, draw(values)) for flag, values in required]
    for _ in range(draw(st.integers(0, 6))):
        action = draw(st.sampled_from(options))
        flag = draw(st.sampled_from(sorted(action.option_strings)))
        form = "value" if parsable else draw(st.sampled_from(["value", "value", "missing", "equals", "unknown"]))
        if form == "unknown":
            parts.append([draw(st.sampled_from(UNKNOWN))])
        elif action.nargs == 0 or form == "missing":
            parts.append([flag])
        elif form == "equals" and flag.startswith("--"):
            parts.append([f"{flag}={draw(values_of(action, parsable))}"])
        else:
            parts.append(option_tokens(flag, draw(values_of(action, parsable))))
    if parsable or draw(st.integers(0, 9)) > 0:
        parts.insert(draw(st.integers(0, len(parts))), [draw(positional)])
    event("argv: parsable" if parsable else "argv: anything")
    return [token for part in parts for token in part]


def run_main(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int | str | None, bool]:
    """(exit status, whether argparse exited) of a command's main, run in-process."""
    try:
        return main(argv), False
    except SystemExit as exc:
        return exc.code, True


def assert_refused(
    prog: str, prefix: str, parser: argparse.ArgumentParser, outcome: tuple[Any, bool], err: str
) -> None:
    """The command line contract: an input error is exit status 2 (1: a failed run) and one line on
    stderr; an argparse usage error is status 2 and its error line (with the usage above it, unless the
    parser prints one line)."""
    code, usage_error = outcome
    lines = err.splitlines()
    assert "Traceback" not in err, err
    if usage_error:
        assert code == 2, (code, err)
        assert lines and lines[-1].startswith(f"{prog}: error: "), err
        if type(parser).error is not argparse.ArgumentParser.error:  # a one-line parser
            assert len(lines) == 1, err
        else:
            assert lines[0].startswith("usage: "), err
        event("usage error")
    else:
        assert code in (1, 2), (code, err)
        assert len(lines) == 1 and lines[0].startswith(prefix), err
        event(f"refused: {lines[0].removeprefix(prefix).split(':')[0][:30]}")


@sizes(150, 1500)
def test_compile_command_lines_fail_fast_with_one_line(
    examples: int, cli_sandbox: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cloudless.compiler import cli

    monkeypatch.chdir(cli_sandbox)
    parser = cli.build_parser()
    before = listing(cli_sandbox)

    models, outputs = st.sampled_from(MODEL_PATHS), st.just("out") | st.sampled_from(OUTPUT_PATHS)

    @fuzz(examples)
    @given(command_lines(parser, models, [("-o", outputs)]))
    @example(["nowhere.py", "-o", "out", "--blocks", "0"])
    @example(["bad.py", "-o", "out", "--solver-time-limit", "nan", "--deadline", "-inf"])
    @example(["--check", "junk", "--bogus"])
    @example(["contract.py", "-o", "out", "-c", "binary.yaml"])
    def check(argv: list[str]) -> None:
        capsys.readouterr()
        with mock.patch("cloudless.compiler.pipeline.trace_model", side_effect=CommandStarted(argv)):
            try:
                outcome = run_main(cli.main, argv)
            except Exception as exc:  # noqa: BLE001 - a traceback: a finding, unless a known one
                known_or_raise(exc)
                return
        out, err = capsys.readouterr()
        assert_refused("cloudless-compile", "cloudless-compile: error: ", parser, outcome, err)
        assert out == "", out
        assert listing(cli_sandbox) == before  # no -o folder (nor anything else) created

    check()


@sizes(150, 1500)
def test_run_command_lines_fail_fast_with_one_line(
    examples: int, cli_sandbox: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cloudless.runtimes import cli as run

    monkeypatch.chdir(cli_sandbox)
    parser = run.build_parser()
    before = listing(cli_sandbox)

    @fuzz(examples)
    @given(command_lines(parser, st.just("nopkg") | st.sampled_from(BUILD_PATHS), [("--out", st.just("out"))]))
    @example(["nopkg", "--out", "out", "--iterations", "0"])
    @example(["nopkg", "--out", "out", "--key-timeout", "nan", "--inject-faults", "inf"])
    @example(["nopkg", "--out", "out", "--invoker", "openfaas", "--token-file", "folder"])
    @example(["badflow", "--out", "out"])
    def check(argv: list[str]) -> None:
        capsys.readouterr()
        with mock.patch("cloudless.runtimes.cli.train", side_effect=CommandStarted(argv)):
            try:
                outcome = run_main(run.main, argv)
            except Exception as exc:  # noqa: BLE001 - a traceback: a finding
                known_or_raise(exc)
                return
        out, err = capsys.readouterr()
        assert_refused("cloudless-run", "cloudless-run: ", parser, outcome, err)
        assert out == "", out
        assert listing(cli_sandbox) == before  # no --out folder (nor anything else) created

    check()


def test_a_model_file_not_utf8_is_one_line(tmp_path: Path, compile_cli: Callable[..., tuple[int, str, str]]) -> None:
    (tmp_path / "binary.py").write_bytes(b"\xff\xfe\x00not utf-8\n")
    code, _, err = compile_cli(str(tmp_path / "binary.py"), "-o", str(tmp_path / "out"), "-q")
    assert code == 2
    assert_one_line(err.strip(), "cloudless-compile: error: ")


# ======================================================================================================
# 3. Invocation payloads and the handler
# ======================================================================================================

#: run names and keys a request may try to escape its prefix with
TRAVERSALS = ["../x", "..", ".", "/etc", "/", "a/../../b", "x/..", "..\\x", "~", "$HOME", "%2e%2e", "", " ", "a b"]
TRAVERSALS += ["\x00", "a\x00b", "\n", "é", "区", "x" * 300, "é" * 130, "r", "run-1", "data", "aws-us-east-1"]
HUGE = [-(2**63), -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30, 10**300]
payload_ints = st.integers(-3, 3) | st.sampled_from(HUGE)
run_values = st.sampled_from(TRAVERSALS) | st.text(max_size=12)
payload_values = st.recursive(
    st.none() | st.booleans() | payload_ints | floats | run_values,
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(run_values, inner, max_size=2),
    max_leaves=4,
)
FIELDS = ("start", "stop", "iteration", "replica", "run", "attempt", "time_limit_s", "timeout")
#: every field a payload may carry (the several-region ones too): an added key is none of them
PAYLOAD_FIELDS = (*FIELDS, *(name for name in Invocation.__dataclass_fields__ if name not in FIELDS))
#: valid and short: a handler example that trains stops within a second
short_seconds = st.floats(0.01, 0.3)
BAD_SECONDS = [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, 10**400, "1", True, False, [], {}]


@st.composite
def invocation_events(draw: st.DrawFn, for_handler: bool = False) -> Any:
    """A valid-looking payload with some fields replaced, deleted or added. For the handler, the time
    limit and key timeout are always there, short or invalid (a payload without them may rightly train
    for ever or wait ten minutes for a checkpoint)."""
    if not for_handler and draw(st.integers(0, 14)) == 0:
        return draw(payload_values)  # not a JSON object
    payload: dict[str, Any] = {"iteration": 0} if draw(st.booleans()) else {"start": 0, "stop": draw(st.integers(1, 3))}
    payload["replica"] = 0
    payload["run"] = draw(st.sampled_from(["", "r", "fuzz"]))
    if draw(st.booleans()):
        payload["attempt"] = draw(st.sampled_from([0, 1]))
    payload["time_limit_s"] = draw(short_seconds)
    payload["timeout"] = draw(short_seconds)
    for name in draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=3)):
        if name in ("time_limit_s", "timeout"):
            payload[name] = draw(
                short_seconds | st.sampled_from(BAD_SECONDS) | (st.none() if not for_handler else st.nothing())
            )
        elif name == "run":
            payload[name] = draw(run_values | payload_values)
        elif not for_handler and draw(st.integers(0, 3)) == 0:
            payload.pop(name, None)
        else:
            payload[name] = draw(payload_ints | payload_values)
    extra = st.text(max_size=8).filter(lambda k: k not in PAYLOAD_FIELDS)
    payload.update(draw(st.dictionaries(extra, payload_values, max_size=2)))
    return payload


def assert_in_bounds(invocation: Invocation) -> None:
    """What an accepted payload guarantees the worker (and every storage key it spells)."""
    for name in ("start", "stop", "replica"):
        value = getattr(invocation, name)
        assert isinstance(value, int) and not isinstance(value, bool), (name, value)
        assert 0 <= value <= MAX_NUMBER, (name, value)
    assert invocation.attempt is None or (
        isinstance(invocation.attempt, int) and not isinstance(invocation.attempt, bool)
    ), invocation.attempt
    assert invocation.attempt is None or 0 <= invocation.attempt <= MAX_NUMBER, invocation.attempt
    run = invocation.run
    # one path segment of every key of the run, that no storage normalises away or cannot hold, and
    # that does not put the run's keys under the training data's prefix
    assert isinstance(run, str) and "/" not in run and ".." not in run and run != ".", run
    assert run.isprintable() and len(run.encode()) <= MAX_RUN_BYTES and run != "data", run
    for name in ("time_limit_s", "timeout"):
        value = getattr(invocation, name)
        assert value is None or (isinstance(value, float) and math.isfinite(value) and value > 0), (name, value)


def assert_bad_request(exc: ValueError) -> None:
    message = str(exc)
    assert_one_line(message)
    assert message.split(":")[0] in (*PAYLOAD_FIELDS, 'expected a JSON object like {"iteration"'), message


@sizes(400, 1500)
def test_invocation_payloads_give_an_invocation_in_bounds_or_a_value_error(examples: int) -> None:
    @fuzz(examples)
    @given(invocation_events())
    @example({"iteration": 0, "run": "x" * 300})  # a file name longer than a folder storage holds
    @example({"iteration": 0, "run": "."})  # a folder storage's path aliases the run without a name
    @example({"iteration": 0, "run": "data"})  # the run's keys under the training data's
    @example({"iteration": 0, "run": "a\x00b"})
    @example({"iteration": 10**300})
    @example({"iteration": 0, "attempt": -1})
    @example({"iteration": -1})
    @example({"iteration": 0, "time_limit_s": 10**400})  # beyond a float: was an OverflowError
    @example({"iteration": MAX_NUMBER})
    def check(payload: Any) -> None:
        try:
            invocation = Invocation.from_json(payload)
        except ValueError as exc:
            assert_bad_request(exc)
            event(f"rejected: {str(exc).split(':')[0][:20]}")
            return
        event("accepted")
        assert_in_bounds(invocation)
        if isinstance(payload, dict) and "iteration" in payload:
            assert invocation.stop == invocation.start + 1
        assert Invocation.from_json(json.loads(json.dumps(invocation.to_json()))) == invocation

    check()


# --- the handler -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def staged_storage(tmp_path_factory: pytest.TempPathFactory, mlp_build: Path) -> Path:
    """A storage folder holding the MLP's training data, as cloudless-run stages it: copied per test."""
    from cloudless.ir.files import load_workflow
    from cloudless.runtimes.control.staging import stage_data
    from cloudless.runtimes.function.data import data_name
    from cloudless.runtimes.storage.channels import DirectoryChannel

    storage = tmp_path_factory.mktemp("fuzz-storage") / "storage"
    region = load_workflow(mlp_build / "workflow.yaml").regions[0]
    stage_data(DirectoryChannel(storage), region.name, MLP, sources=region.data_sources, name=data_name(region))
    return storage


def files_of(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under `folder` as (size, mtime, inode): os.replace changes the inode. Bytecode caches
    are left out: test_known_handler_writes_bytecode_into_its_package pins that bug."""
    found = {}
    for path in folder.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            stat = path.stat()
            found[path.relative_to(folder).as_posix()] = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
    return found


class Recorder:
    """The keys a handler's folder storage is asked for (every access goes through `_path`). One per
    test: the warm worker keeps the channel it opened first, so each example clears the list."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.lock = threading.Lock()

    def channel(self, location: str) -> Any:
        from cloudless.runtimes.storage.channels import DirectoryChannel

        recorder = self

        class RecordingChannel(DirectoryChannel):
            def _path(self, key: str) -> Path:
                with recorder.lock:
                    recorder.keys.append(key)
                return super()._path(key)

        return RecordingChannel(location)


@dataclass(frozen=True)
class Function:
    """The compiled sample's one function, and the storage its invocations use in this test."""

    build: Path
    package: Path
    region: str
    checkpoint_every: int
    storage: Path
    data_prefix: str  # the training data's keys: read, never written
    recorder: Recorder


def check_handler(function: Function, payload: Any) -> None:
    """One payload through handle_request: a result or a one-line bad request, and nothing touched
    (read, written, deleted) outside the run's prefix and the training data."""
    from cloudless.runtimes.function import worker
    from cloudless.runtimes.storage.channels import KeyTimeout

    try:
        invocation: Invocation | None = Invocation.from_json(payload)
    except ValueError:
        invocation = None
    storage_before, build_before = files_of(function.storage), files_of(function.build)
    function.recorder.keys.clear()
    try:
        result = worker.handle_request(function.package, payload, str(function.storage))
    except ValueError as exc:  # a bad request (400)
        assert_one_line(str(exc))
        event("bad request")
        result = None
    except KeyTimeout as exc:  # a resume from a checkpoint nobody wrote: a failed run (500)
        assert invocation is not None and invocation.start > 0, exc
        assert_one_line(str(exc))
        event("key timeout")
        result = None
    if result is not None:
        assert invocation is not None, (payload, result)
        event(f"result: {result['status']}")
        assert result["status"] in ("done", "duplicate", "diverged", "aborted"), result
        assert (result["start"], result["replica"]) == (invocation.start, invocation.replica), result
        if result["status"] == "done" and not result["duplicate"]:
            assert invocation.start <= result["resumed"] <= result["stop"] <= invocation.stop, result
        json.dumps(result, allow_nan=False)
    # Only the run's own prefix, and the staged training data; every segment of a key a plain name.
    prefix = f"{namespace(invocation.run, function.region)}/" if invocation is not None else None
    assert prefix is None or not prefix.startswith(function.data_prefix.split("/")[0] + "/"), prefix
    for key in function.recorder.keys:
        assert all(part not in ("", ".", "..") for part in key.split("/")), key
        assert (prefix is not None and key.startswith(prefix)) or key.startswith(function.data_prefix), (key, prefix)
    storage_after = files_of(function.storage)
    changed = {p for p in storage_before.keys() | storage_after.keys() if storage_before.get(p) != storage_after.get(p)}
    for path in changed:  # on disk, the run's folder literally (no path normalisation aliasing it)
        assert prefix is not None and path.startswith(prefix), (path, prefix)
    assert files_of(function.build) == build_before  # the function's package is read-only


@sizes(30, 200)
def test_handler_answers_or_refuses_and_stays_in_its_prefix(
    examples: int, mlp_build: Path, staged_storage: Path, tmp_path: Path
) -> None:
    from cloudless.ir.files import load_workflow
    from cloudless.runtimes.function import worker
    from cloudless.runtimes.function.data import data_name

    workflow = load_workflow(mlp_build / "workflow.yaml")
    region = workflow.regions[0]
    storage = tmp_path / "storage"
    shutil.copytree(staged_storage, storage)
    recorder = Recorder()
    function = Function(
        build=mlp_build,
        package=mlp_build / region.functions[0].package,
        region=region.name,
        checkpoint_every=workflow.run.checkpoint_every,
        storage=storage,
        data_prefix=f"data/{data_name(region)}/",
        recorder=recorder,
    )

    @fuzz(examples)
    @given(invocation_events(for_handler=True))
    @example({"iteration": 0, "run": "r", "time_limit_s": 0.2, "timeout": 0.2})
    @example({"start": 0, "stop": 10**6, "run": "r", "attempt": 0, "time_limit_s": 0.05, "timeout": 0.2})
    @example({"iteration": 5, "run": "r", "time_limit_s": 0.2, "timeout": 0.05})
    @example({"iteration": 0, "run": "../x", "time_limit_s": 0.2, "timeout": 0.2})
    @example({"iteration": 0, "run": "a/../../b", "time_limit_s": 0.2, "timeout": 0.2})
    @example({"iteration": 0, "run": "/etc", "time_limit_s": 0.2, "timeout": 0.2})
    @example({"iteration": 0, "run": ".", "time_limit_s": 0.2, "timeout": 0.2})  # was: the run-less keys
    @example({"iteration": 0, "run": "data", "time_limit_s": 0.2, "timeout": 0.2})  # was: under the data
    @example({"iteration": 0, "run": "x" * 300, "time_limit_s": 0.2, "timeout": 0.2})  # was: an OSError
    @example({"iteration": 10**30, "run": "r", "time_limit_s": 0.2, "timeout": 0.05})
    @example({"iteration": 0, "run": "r", "attempt": 10**300, "time_limit_s": 0.2, "timeout": 0.2})  # was: OSError
    @example({"iteration": 0, "replica": 2**64, "run": "r", "time_limit_s": 0.2, "timeout": 0.2})
    def check(payload: Any) -> None:
        check_handler(function, payload)

    try:
        with mock.patch.object(worker, "open_channel", recorder.channel):
            check()
    finally:
        worker._IDLE.pop((str(function.package), str(storage)), None)  # this test's warm worker


class _Runaway(Exception):
    """The storage was asked for more keys than any invocation of a two-iteration range needs."""


def test_a_retried_invocation_of_a_huge_range_starts_at_once(
    mlp_build: Path, staged_storage: Path, tmp_path: Path
) -> None:
    """A retried (attempt != 0, or no attempt) invocation of iterations 0..10**12 with a time limit finds
    where to resume in a few reads (it used to look for a checkpoint at every multiple of checkpoint_every
    from the top of its range down, 2 * 10**10 requests, before training one iteration)."""
    from cloudless.ir.files import load_workflow
    from cloudless.runtimes.function import worker
    from cloudless.runtimes.storage.channels import DirectoryChannel

    region = load_workflow(mlp_build / "workflow.yaml").regions[0]
    package = mlp_build / region.functions[0].package
    storage = tmp_path / "storage"
    shutil.copytree(staged_storage, storage)
    asked = [0]

    class Counting(DirectoryChannel):
        def _read(self, key: str) -> bytes | None:
            asked[0] += 1
            if asked[0] > 10_000:
                raise _Runaway(f"{asked[0]} reads, the last {key}")
            return super()._read(key)

    payload = {"start": 0, "stop": 10**12, "run": "r", "attempt": 1, "time_limit_s": 0.2, "timeout": 0.2}
    try:
        with mock.patch.object(worker, "open_channel", Counting):
            result = worker.handle_request(package, payload, str(storage))
    finally:
        worker._IDLE.pop((str(package), str(storage)), None)
    assert result["status"] == "done" and result["stop"] >= 1


def test_bytecode_a_handler_writes_into_its_package_does_not_block_a_recompile(
    mlp_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Python writes bytecode (its default; this suite's environment may switch it off), a
    handler's first request imports stage.py and loss.py from its package and leaves __pycache__/ there
    (cloudless-run's function processes write none): a recompile into the build still accepts it."""
    from cloudless.ir.files import load_workflow
    from cloudless.ir.folders import check_output_folder
    from cloudless.runtimes.function import worker

    build = tmp_path / "build"
    shutil.copytree(mlp_build, build)
    package = build / load_workflow(build / "workflow.yaml").regions[0].functions[0].package
    storage = tmp_path / "storage"
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    try:
        with pytest.raises(ValueError, match="has replicas 0..0"):  # the worker loads, then refuses
            worker.handle_request(package, {"iteration": 0, "replica": 5, "timeout": 0.2}, str(storage))
    finally:
        worker._IDLE.pop((str(package), str(storage)), None)
    assert list(build.rglob("__pycache__"))  # (so the check below has something to tolerate)
    check_output_folder(build, "build")  # a recompile into it is still accepted


def test_handler_fixture_is_a_single_function(mlp_build: Path) -> None:
    """The handler tests call one function alone: the compiled sample must be one stage, one replica
    (more would wait for neighbours that never run)."""
    from cloudless.ir.files import load_workflow

    functions = load_workflow(mlp_build / "workflow.yaml").regions[0].functions
    assert [(f.stage, f.replicas) for f in functions] == [(0, 1)]
    assert os.path.isfile(mlp_build / functions[0].package / "handler.py")
