"""The Step Functions state machines of a SAM template: the resource (its name, definition file,
substitutions and role) and the Amazon States Language definition (size, statelint, Map concurrency,
Lambda tasks with their retries and catches)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ...ir.catalog import DISTRIBUTED_MAP_MAX_CONCURRENCY, INLINE_MAP_MAX_CONCURRENCY
from ...ir.workflow import Region
from ..platforms import LAMBDA_INVOKE, LAMBDA_RETRY_ERRORS, STATE_MACHINE_NAME_LIMIT
from .base import AWS_NAME, build_relative, fail

#: Step Functions' limit on a state machine definition.
MAX_DEFINITION_BYTES = 1024 * 1024
#: Stands in for the function ARNs that DefinitionSubstitutions fill in at deploy time.
DUMMY_ARN = "arn:aws:lambda:us-east-1:123456789012:function:{name}"
#: The longest ARN a substitution can bring (64-character function name, longest region name), so that the
#: size check is not optimistic.
LONGEST_ARN = len("arn:aws-us-gov:lambda:ap-southeast-5:123456789012:function:") + 64
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_]+)\}")


def check_state_machine(build: Path, template_path: Path, name: str, resource: dict[str, Any], region: Region) -> None:
    file = build_relative(build, template_path)
    key = f"Resources/{name}/Properties"
    properties = resource.get("Properties", {})
    machine = properties.get("Name")
    if not isinstance(machine, str) or not AWS_NAME.fullmatch(machine) or len(machine) > STATE_MACHINE_NAME_LIMIT:
        # its Distributed Map's policy names it, and the controller finds it by it
        fail(
            file,
            f"{key}/Name",
            f"{machine!r}; a state machine's name is letters, digits, '-' and '_', at most {STATE_MACHINE_NAME_LIMIT}",
        )
    uri = properties.get("DefinitionUri")
    if not isinstance(uri, str):
        fail(file, f"{key}/DefinitionUri", "expected the definition file next to the template")
    definition_path = template_path.parent / uri
    if not definition_path.is_file():
        fail(file, f"{key}/DefinitionUri", f"no file {uri!r}")
    text = definition_path.read_text()
    substitutions = properties.get("DefinitionSubstitutions", {})
    placeholders = sorted(set(_PLACEHOLDER.findall(text)))
    for placeholder in placeholders:
        if placeholder not in substitutions:
            fail(file, f"{key}/DefinitionSubstitutions", f"{uri} uses ${{{placeholder}}}, which is not substituted")
    for substitution in substitutions:
        if substitution not in placeholders:
            fail(file, f"{key}/DefinitionSubstitutions/{substitution}", f"not used in {uri}")
    workers = sum(f.replicas for f in region.functions)
    check_definition(build_relative(build, definition_path), text, workers)
    if _distributed(json.loads(substitute_arns(text)).get("States", {})):
        # a Distributed Map starts its iterations as executions of this state machine: its role must allow it
        allowed = [
            statement.get("Resource")
            for policy in properties.get("Policies", [])
            if isinstance(policy, dict)
            for statement in policy.get("Statement", [])
            if isinstance(statement, dict) and "states:StartExecution" in _as_list(statement.get("Action"))
        ]
        own = f":stateMachine:{machine}"
        if not any(isinstance(r, dict) and str(r.get("Fn::Sub", "")).endswith(own) for r in allowed):
            fail(
                file,
                f"{key}/Policies",
                f"{uri} runs a Distributed Map, but no statement allows states:StartExecution on state machine "
                f"{machine}",
            )


def _distributed(states: dict[str, Any]) -> bool:
    """Whether a state machine's states hold a Distributed Map (at any depth)."""
    for state in states.values():
        processor = state.get("ItemProcessor") or state.get("Iterator") or {}
        if (processor.get("ProcessorConfig") or {}).get("Mode") == "DISTRIBUTED":
            return True
        branches = [processor, *state.get("Branches", [])]
        if any(_distributed(branch.get("States", {})) for branch in branches):
            return True
    return False


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def substitute_arns(text: str) -> str:
    """The definition with every `${Name}` placeholder replaced by a Lambda ARN (for linting)."""
    return _PLACEHOLDER.sub(lambda m: DUMMY_ARN.format(name=m.group(1)[:64]), text)


def check_definition(file: str, text: str, workers: int) -> None:
    """Check a state machine definition (placeholders allowed) that invokes `workers` functions per Map."""
    from statelint.linter import Linter

    size = len(_PLACEHOLDER.sub("x" * LONGEST_ARN, text).encode())
    if size > MAX_DEFINITION_BYTES:
        fail(file, "(top level)", f"about {size} bytes once substituted; Step Functions allows {MAX_DEFINITION_BYTES}")
    substituted = substitute_arns(text)
    try:
        definition = json.loads(substituted)
    except json.JSONDecodeError as exc:
        fail(file, "(top level)", f"not JSON: {exc}")
    problems = Linter.validate(definition)
    if problems:
        fail(file, _statelint_key(problems[0]), f"statelint: {problems[0]}")
    _check_states(file, definition.get("States", {}), ["States"], workers)


def _statelint_key(problem: str) -> str:
    """statelint names places as `State Machine.States.X.Retry[0].BackoffRate`; make that a key path."""
    match = re.search(r"State Machine((?:\.[A-Za-z0-9_\-]+|\[\d+\])+)", problem)
    if not match:
        return "(definition)"
    return "/".join(re.findall(r"[A-Za-z0-9_\-]+", match.group(1)))


def _check_states(file: str, states: dict[str, Any], where: list[str], workers: int) -> None:
    for name, state in states.items():
        key = "/".join([*where, name])
        kind = state.get("Type")
        if kind == "Map":
            config = (state.get("ItemProcessor") or {}).get("ProcessorConfig") or {}
            mode = config.get("Mode", "INLINE")
            if mode == "DISTRIBUTED" and config.get("ExecutionType") != "STANDARD":
                # an Express child execution ends after 5 minutes; a worker may run up to Lambda's 15
                fail(file, f"{key}/ItemProcessor/ProcessorConfig/ExecutionType", "expected STANDARD")
            most = DISTRIBUTED_MAP_MAX_CONCURRENCY if mode == "DISTRIBUTED" else INLINE_MAP_MAX_CONCURRENCY
            concurrency = state.get("MaxConcurrency")
            if not isinstance(concurrency, int) or not 1 <= concurrency <= most:
                fail(
                    file,
                    f"{key}/MaxConcurrency",
                    f"{concurrency!r}; {'a Distributed' if mode == 'DISTRIBUTED' else 'an inline'} Map runs at most "
                    f"{most} iterations at once",
                )
            if concurrency < workers:
                # The stages wait on each other's activations: a worker left queued deadlocks the iteration.
                fail(file, f"{key}/MaxConcurrency", f"{concurrency} < the region's {workers} workers")
            processor = state.get("ItemProcessor") or state.get("Iterator") or {}
            inner = "ItemProcessor" if "ItemProcessor" in state else "Iterator"
            _check_states(file, processor.get("States", {}), [*where, name, inner, "States"], workers)
        elif kind == "Parallel":
            for index, branch in enumerate(state.get("Branches", [])):
                _check_states(file, branch.get("States", {}), [*where, name, "Branches", str(index), "States"], workers)
        elif kind == "Task":
            if state.get("Resource") != LAMBDA_INVOKE:
                fail(file, f"{key}/Resource", f"{state.get('Resource')!r}; expected {LAMBDA_INVOKE}")
            retried = {error for retry in state.get("Retry", []) for error in retry.get("ErrorEquals", [])}
            missing = [error for error in LAMBDA_RETRY_ERRORS if error not in retried and "States.ALL" not in retried]
            if missing:
                fail(file, f"{key}/Retry", f"no retry on {', '.join(missing)}")
            caught = {error for catch in state.get("Catch", []) for error in catch.get("ErrorEquals", [])}
            if "States.ALL" not in caught:
                fail(file, f"{key}/Catch", "no Catch on States.ALL")
