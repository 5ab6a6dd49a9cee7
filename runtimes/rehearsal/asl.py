"""An interpreter of Amazon States Language, the subset Cloudless's state machines use: it runs the
generated state machines in `cloudless-run --invoker lambda --rehearse` (runtimes/rehearsal/stepfunctions_local.py)
and in the tests.

States: Pass (Result, Parameters), Choice (IsPresent, Numeric*/String*/Boolean* comparisons and their
*Path forms, And/Or/Not, Default), Task (`arn:aws:states:::lambda:invoke`: the result is
{"Payload": <the function's return>, "StatusCode": 200, ...}), Map (ItemsPath, ItemSelector with
`$$.Map.Item.Value`/`Index`, MaxConcurrency, ItemProcessor inline or DISTRIBUTED: a child execution
per item, or the older Iterator), Parallel (Branches), Succeed and Fail (Error/Cause, ErrorPath/CausePath).
Input and output processing in the specification's order: InputPath, Parameters (ItemSelector),
the state's work, ResultSelector, ResultPath (null keeps the input; a path sets the result into it),
OutputPath. Payload templates: fields ending in `.$` take a path (`$.x`, `$$.Execution.Name`, the
context object) or an intrinsic function (States.MathAdd, States.Format, States.Array,
States.StringToJson, States.JsonToString, States.ArrayGetItem, States.ArrayLength).
Errors: Retry (ErrorEquals with States.ALL and States.TaskFailed, IntervalSeconds, MaxAttempts,
BackoffRate, MaxDelaySeconds; `time_scale` shortens the waits) and Catch (ErrorEquals, ResultPath of
{"Error", "Cause"} on the state's input, Next). A failure nobody catches fails the execution
(ExecutionFailed with its Error and Cause); a Map or Parallel fails with the first failure of its
iterations or branches. `Execution.stop()` (StopExecution) ends a running execution at its next state
or retry wait with ExecutionAborted; a Lambda invoke under way finishes, as on AWS, and its result is dropped.

The Lambda invoke is a callable `invoke(function_name, payload) -> result` given to the Execution; a
function's error is a `FunctionError(error_type, message)` (Step Functions names the error after the
function's errorType), other service errors a FunctionError named like `Lambda.ServiceException`.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from copy import deepcopy
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

LAMBDA_INVOKE = "arn:aws:states:::lambda:invoke"
#: the error of a stopped execution
ABORTED = "States.Aborted"
#: Step Functions' limit on a task's result (and any state's input or output), UTF-8 bytes
PAYLOAD_LIMIT = 256 * 1024
_MISSING = object()


class StatesError(Exception):
    """A failure inside an execution: its ASL error name and cause."""

    def __init__(self, error: str, cause: str = "") -> None:
        super().__init__(f"{error}: {cause}")
        self.error, self.cause = error, cause


class FunctionError(StatesError):
    """What a Lambda invoke raises: the function's errorType (or a Lambda.* service error) and message."""


class ExecutionFailed(StatesError):
    """The execution ended in a Fail state or an uncaught error."""


class ExecutionAborted(StatesError):
    """The execution was stopped (StopExecution): no Retry or Catch applies."""


Invoke = Callable[[str, Any], Any]


# --- paths ----------------------------------------------------------------------------------------

_SEGMENT = re.compile(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]|\['([^']*)'\]")


def _segments(path: str) -> list[str | int]:
    if path.startswith("$$"):
        rest = path[2:]
    elif path.startswith("$"):
        rest = path[1:]
    else:
        raise StatesError("States.Runtime", f"not a path: {path!r}")
    out: list[str | int] = []
    at = 0
    while at < len(rest):
        match = _SEGMENT.match(rest, at)
        if match is None:
            raise StatesError("States.Runtime", f"unsupported path {path!r}")
        name, index, quoted = match.groups()
        out.append(int(index) if index is not None else (name if name is not None else quoted))
        at = match.end()
    return out


def read_path(path: str, data: Any, context: Any = None) -> Any:
    """The value at `path` (`$...` in data, `$$...` in the context object); _MISSING when absent."""
    value = context if path.startswith("$$") else data
    for segment in _segments(path):
        if isinstance(segment, int):
            if not isinstance(value, list) or segment >= len(value):
                return _MISSING
            value = value[segment]
        else:
            if not isinstance(value, dict) or segment not in value:
                return _MISSING
            value = value[segment]
    return value


def get_path(path: str, data: Any, context: Any = None) -> Any:
    value = read_path(path, data, context)
    if value is _MISSING:
        raise StatesError("States.Runtime", f"The JSONPath {path!r} could not be found in the input")
    return value


def set_path(path: str, data: Any, value: Any) -> Any:
    """ResultPath: `value` placed at `path` in (a copy of) `data`."""
    segments = _segments(path)
    if not segments:
        return value
    out = deepcopy(data) if isinstance(data, dict) else {}
    node = out
    for segment in segments[:-1]:
        if not isinstance(segment, str):
            raise StatesError("States.ResultPathMatchFailure", f"cannot set {path!r}")
        child = node.get(segment)
        if not isinstance(child, dict):
            child = node[segment] = {}
        node = child
    last = segments[-1]
    if not isinstance(last, str):
        raise StatesError("States.ResultPathMatchFailure", f"cannot set {path!r}")
    node[last] = value
    return out


# --- payload templates and intrinsic functions ------------------------------------------------------


def _split_arguments(text: str) -> list[str]:
    parts, depth, quoted, current = [], 0, False, ""
    for index, char in enumerate(text):
        if char == "'" and (index == 0 or text[index - 1] != "\\"):
            quoted = not quoted
        if not quoted and char == "(":
            depth += 1
        elif not quoted and char == ")":
            depth -= 1
        if char == "," and depth == 0 and not quoted:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def _argument(text: str, data: Any, context: Any) -> Any:
    if text.startswith("$"):
        return get_path(text, data, context)
    if text.startswith("States."):
        return intrinsic(text, data, context)
    if text.startswith("'") and text.endswith("'"):
        return text[1:-1].replace("\\'", "'")
    return json.loads(text)


def intrinsic(text: str, data: Any, context: Any) -> Any:
    match = re.fullmatch(r"(States\.\w+)\((.*)\)", text.strip(), re.S)
    if match is None:
        raise StatesError("States.Runtime", f"not an intrinsic function: {text!r}")
    name, arguments = match.group(1), [_argument(a, data, context) for a in _split_arguments(match.group(2))]
    if name == "States.MathAdd":
        a, b = arguments
        return a + b
    if name == "States.Format":
        template, *values = arguments
        pieces = template.split("{}")
        if len(pieces) - 1 != len(values):
            raise StatesError("States.IntrinsicFailure", f"{text}: {len(values)} values for {len(pieces) - 1} {{}}")
        out = pieces[0]
        for value, piece in zip(values, pieces[1:], strict=True):
            out += (value if isinstance(value, str) else json.dumps(value)) + piece
        return out
    if name == "States.Array":
        return list(arguments)
    if name == "States.StringToJson":
        return json.loads(arguments[0])
    if name == "States.JsonToString":
        return json.dumps(arguments[0], separators=(",", ":"))
    if name == "States.ArrayGetItem":
        return arguments[0][arguments[1]]
    if name == "States.ArrayLength":
        return len(arguments[0])
    raise StatesError("States.Runtime", f"intrinsic function {name} is not supported here")


def template(value: Any, data: Any, context: Any) -> Any:
    """Parameters, ItemSelector, ResultSelector: a copy of `value` with each `key.$` evaluated."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key.endswith(".$"):
                if not isinstance(item, str):
                    raise StatesError("States.Runtime", f"{key}: expected a path or intrinsic function")
                out[key[:-2]] = (
                    intrinsic(item, data, context) if item.startswith("States.") else get_path(item, data, context)
                )
            else:
                out[key] = template(item, data, context)
        return out
    if isinstance(value, list):
        return [template(item, data, context) for item in value]
    return value


# --- choice rules -------------------------------------------------------------------------------------

_COMPARISONS: dict[str, Callable[[Any, Any], bool]] = {
    "Equals": lambda a, b: a == b,
    "LessThan": lambda a, b: a < b,
    "GreaterThan": lambda a, b: a > b,
    "LessThanEquals": lambda a, b: a <= b,
    "GreaterThanEquals": lambda a, b: a >= b,
}
_KINDS: dict[str, Callable[[Any], bool]] = {
    "Numeric": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "String": lambda v: isinstance(v, str),
    "Boolean": lambda v: isinstance(v, bool),
    "Timestamp": lambda v: isinstance(v, str),
}


def choice_matches(rule: dict[str, Any], data: Any, context: Any) -> bool:
    if "And" in rule:
        return all(choice_matches(r, data, context) for r in rule["And"])
    if "Or" in rule:
        return any(choice_matches(r, data, context) for r in rule["Or"])
    if "Not" in rule:
        return not choice_matches(rule["Not"], data, context)
    value = read_path(rule["Variable"], data, context)
    for key, operand in rule.items():
        if key in ("Variable", "Next", "Comment"):
            continue
        if key == "IsPresent":
            return (value is not _MISSING) == operand
        if value is _MISSING:
            raise StatesError("States.Runtime", f"Invalid path {rule['Variable']!r}: the choice state's input has none")
        if key == "IsNull":
            return (value is None) == operand
        if key == "IsNumeric":
            return _KINDS["Numeric"](value) == operand
        if key == "IsString":
            return isinstance(value, str) == operand
        if key == "IsBoolean":
            return isinstance(value, bool) == operand
        by_path = key.endswith("Path")
        name = key[:-4] if by_path else key
        kind = next((k for k in _KINDS if name.startswith(k)), None)
        if kind is None or name[len(kind) :] not in _COMPARISONS:
            raise StatesError("States.Runtime", f"choice operator {key} is not supported here")
        other = get_path(operand, data, context) if by_path else operand
        if not (_KINDS[kind](value) and _KINDS[kind](other)):
            return False
        return _COMPARISONS[name[len(kind) :]](value, other)
    raise StatesError("States.Runtime", f"choice rule without a comparison: {rule}")


# --- errors --------------------------------------------------------------------------------------------


def _error_matches(names: list[str], error: str) -> bool:
    if error == ABORTED:
        return False
    if "States.ALL" in names:
        return True
    if "States.TaskFailed" in names and error != "States.Timeout":
        return True
    return error in names


# --- executions ----------------------------------------------------------------------------------------


@dataclass
class TaskCall:
    """One Lambda invoke the execution made: the function, the payload, what came of it."""

    function: str
    payload: Any
    began: float
    ended: float = 0.0
    result: Any = None
    error: str | None = None


@dataclass
class Execution:
    """One execution of a state machine. `run()` runs it to its end and returns its output (or raises
    ExecutionFailed); meanwhile `status` is RUNNING, then SUCCEEDED or FAILED."""

    definition: dict[str, Any]
    input: Any
    invoke: Invoke
    name: str = field(default_factory=lambda: uuid.uuid4().hex)
    state_machine: str = "arn:aws:states:us-east-1:123456789012:stateMachine:machine"
    time_scale: float = 1.0  # Retry's waits are multiplied by this
    status: str = "RUNNING"
    output: Any = None
    error: str | None = None
    cause: str | None = None
    calls: list[TaskCall] = field(default_factory=list)
    child_executions: int = 0
    events: int = 0  # states entered and exited, tasks scheduled and done: about the history's size
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: threading.Event = field(default_factory=threading.Event)

    def stop(self) -> None:
        """StopExecution: the execution ends at its next state (or retry wait) as ABORTED."""
        self._stopped.set()

    def _check_stopped(self) -> None:
        if self._stopped.is_set():
            raise ExecutionAborted(ABORTED, "the execution was stopped")
        if any(ended.is_set() for ended in _ended_around()):
            raise ExecutionAborted(ABORTED, "another iteration of its Map (or branch of its Parallel) failed")

    def _pause(self, seconds: float) -> None:
        """A Retry's wait; it ends early, with ExecutionAborted, when the execution is stopped or a sibling
        iteration failed."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self._check_stopped()
            self._stopped.wait(min(left, 0.05))
        self._check_stopped()

    def run(self) -> Any:
        started = datetime.now(UTC).isoformat()
        self.context = {
            "Execution": {
                "Id": f"{self.state_machine.replace(':stateMachine:', ':execution:')}:{self.name}",
                "Name": self.name,
                "Input": self.input,
                "StartTime": started,
            },
            "StateMachine": {"Id": self.state_machine},
        }
        try:
            self.output = self._machine(self.definition, deepcopy(self.input), self.context)
        except ExecutionAborted:
            self.status = "ABORTED"
            raise
        except StatesError as exc:
            self.status, self.error, self.cause = "FAILED", exc.error, exc.cause
            raise ExecutionFailed(exc.error, exc.cause) from exc
        self.status = "SUCCEEDED"
        return self.output

    def _count(self, events: int = 1) -> None:
        with self._lock:
            self.events += events

    def _machine(self, machine: dict[str, Any], data: Any, context: dict[str, Any]) -> Any:
        states = machine["States"]
        name = machine["StartAt"]
        while True:
            self._check_stopped()
            state = states[name]
            self._count(2)
            context = {**context, "State": {"Name": name, "EnteredTime": datetime.now(UTC).isoformat()}}
            kind = state["Type"]
            if kind == "Succeed":
                return self._output(state, self._input(state, data, context))
            if kind == "Fail":
                error = get_path(state["ErrorPath"], data, context) if "ErrorPath" in state else state.get("Error")
                cause = get_path(state["CausePath"], data, context) if "CausePath" in state else state.get("Cause")
                raise StatesError(str(error or "States.Fail"), str(cause or ""))
            if kind == "Choice":
                effective = self._input(state, data, context)
                chosen = next(
                    (r["Next"] for r in state["Choices"] if choice_matches(r, effective, context)),
                    state.get("Default"),
                )
                if chosen is None:
                    raise StatesError("States.NoChoiceMatched", f"state {name}: no choice matched")
                data, name = self._output(state, effective), chosen
                continue
            try:
                data = self._work(name, state, data, context)
            except StatesError as exc:
                caught = next((c for c in state.get("Catch", []) if _error_matches(c["ErrorEquals"], exc.error)), None)
                if caught is None:
                    raise
                data = set_path(caught.get("ResultPath", "$"), data, {"Error": exc.error, "Cause": exc.cause})
                name = caught["Next"]
                continue
            if state.get("End"):
                return data
            name = state["Next"]

    @staticmethod
    def _input(state: dict[str, Any], data: Any, context: Any) -> Any:
        path = state.get("InputPath", "$")
        return {} if path is None else get_path(path, data, context)

    @staticmethod
    def _output(state: dict[str, Any], data: Any) -> Any:
        path = state.get("OutputPath", "$")
        return {} if path is None else get_path(path, data)

    def _work(self, name: str, state: dict[str, Any], data: Any, context: dict[str, Any]) -> Any:
        """A Pass, Task, Map or Parallel state: its output from its raw input `data`, retried as its
        Retry says."""
        retriers = state.get("Retry", [])
        tries = [0] * len(retriers)
        while True:
            try:
                return self._once(state, data, context)
            except StatesError as exc:
                index = next((i for i, r in enumerate(retriers) if _error_matches(r["ErrorEquals"], exc.error)), None)
                if index is None:
                    raise
                retrier = retriers[index]
                if tries[index] >= retrier.get("MaxAttempts", 3):
                    raise
                wait = retrier.get("IntervalSeconds", 1) * retrier.get("BackoffRate", 2.0) ** tries[index]
                wait = min(wait, retrier.get("MaxDelaySeconds", wait))
                tries[index] += 1
                self._pause(wait * self.time_scale)

    def _once(self, state: dict[str, Any], data: Any, context: dict[str, Any]) -> Any:
        effective = self._input(state, data, context)
        kind = state["Type"]
        if kind == "Pass":
            if "Parameters" in state:
                effective = template(state["Parameters"], effective, context)
            result = state.get("Result", effective)
        else:
            if "Parameters" in state and kind != "Map":
                effective = template(state["Parameters"], effective, context)
            if kind == "Task":
                result = self._task(state, effective)
            elif kind == "Map":
                result = self._map(state, effective, context)
            elif kind == "Parallel":
                result = self._parallel(state, effective, context)
            else:
                raise StatesError("States.Runtime", f"state type {kind} is not supported here")
            if "ResultSelector" in state:
                result = template(state["ResultSelector"], result, context)
        if "ResultPath" in state and state["ResultPath"] is None:
            combined = data
        else:
            combined = set_path(state.get("ResultPath", "$"), data, result)
        return self._output(state, combined)

    def _task(self, state: dict[str, Any], parameters: Any) -> Any:
        resource = state["Resource"]
        if resource != LAMBDA_INVOKE:
            raise StatesError("States.Runtime", f"resource {resource} is not supported here")
        if not isinstance(parameters, dict) or "FunctionName" not in parameters:
            raise StatesError("States.Runtime", "a Lambda invoke needs FunctionName")
        call = TaskCall(parameters["FunctionName"], parameters.get("Payload"), time.time())
        with self._lock:
            self.calls.append(call)
        self._count(3)
        try:
            payload = self.invoke(call.function, deepcopy(call.payload))
        except StatesError as exc:
            call.error, call.ended = exc.error, time.time()
            raise
        call.result, call.ended = payload, time.time()
        self._check_stopped()  # stopped meanwhile: the function's answer goes nowhere
        size = len(json.dumps(payload).encode())
        if size > PAYLOAD_LIMIT:
            raise StatesError(
                "States.DataLimitExceeded", f"the task's result has {size} bytes, more than the limit {PAYLOAD_LIMIT}"
            )
        return {"ExecutedVersion": "$LATEST", "Payload": payload, "StatusCode": 200}

    def _map(self, state: dict[str, Any], effective: Any, context: dict[str, Any]) -> list[Any]:
        if "ItemReader" in state:
            raise StatesError("States.Runtime", "ItemReader is not supported here")
        items = get_path(state.get("ItemsPath", "$"), effective, context)
        if not isinstance(items, list):
            raise StatesError("States.Runtime", "the Map's items are not an array")
        processor = state.get("ItemProcessor") or state.get("Iterator")
        assert processor is not None
        distributed = processor.get("ProcessorConfig", {}).get("Mode") == "DISTRIBUTED"
        selector = state.get("ItemSelector", state.get("Parameters"))
        concurrency = state.get("MaxConcurrency", 0) or len(items) or 1

        def one(index: int) -> Any:
            item_context = {**context, "Map": {"Item": {"Index": index, "Value": items[index]}}}
            value = template(selector, effective, item_context) if selector is not None else items[index]
            if distributed:  # a child execution: a context of its own
                with self._lock:
                    self.child_executions += 1
                child = {k: v for k, v in context.items() if k != "State"}
                child["Execution"] = {**context["Execution"], "Name": f"{self.name}-{index}", "Input": value}
                return self._machine(processor, value, child)
            return self._machine(processor, value, item_context)

        return self._all([functools.partial(one, i) for i in range(len(items))], concurrency)

    def _parallel(self, state: dict[str, Any], effective: Any, context: dict[str, Any]) -> list[Any]:
        branches = state["Branches"]
        jobs = [functools.partial(self._machine, b, deepcopy(effective), context) for b in branches]
        return self._all(jobs, len(branches))

    @staticmethod
    def _all(jobs: Sequence[Callable[[], Any]], concurrency: int) -> list[Any]:
        """Every job, at most `concurrency` at once; their results in order. The first failure fails the
        whole at once, as a Map or Parallel state does: the other jobs stop at their next state or retry
        wait (a Lambda invoke under way finishes, its answer dropped), and nobody waits for them."""
        if not jobs:
            return []
        ended, around = threading.Event(), _ended_around()

        def run(job: Callable[[], Any]) -> Any:
            _BRANCHES.ended = (*around, ended)
            try:
                return job()
            finally:
                _BRANCHES.ended = around  # the pool's threads run the next job

        pool = ThreadPoolExecutor(max_workers=concurrency)
        futures = [pool.submit(run, job) for job in jobs]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            failures = [f.exception() for f in futures if f.done() and f.exception() is not None]
            if failures:
                ended.set()
                raise failures[0]  # type: ignore[misc]
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=not ended.is_set(), cancel_futures=True)


#: per thread: the events of the Map iterations and Parallel branches it runs within, set when one of their
#: siblings failed (the thread's job then stops)
_BRANCHES = threading.local()


def _ended_around() -> tuple[threading.Event, ...]:
    return getattr(_BRANCHES, "ended", ())


def substitute(definition: str, substitutions: dict[str, str]) -> dict[str, Any]:
    """The definition with SAM's DefinitionSubstitutions (${Name}) replaced; KeyError if one is missing."""
    return json.loads(re.sub(r"\$\{(\w+)\}", lambda m: substitutions[m.group(1)], definition))
