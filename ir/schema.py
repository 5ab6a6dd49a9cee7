"""JSON Schemas of the IR files, shipped as package data, and one validation entry point."""

from __future__ import annotations

import json
import math
from functools import cache
from importlib import resources
from typing import Any

import jsonschema


class SchemaError(ValueError):
    """A document does not match its schema; the message names the file and the key."""


@cache
def load_schema(name: str) -> dict[str, Any]:
    """The schema called `name` (for example "graph" or "blocks")."""
    text = resources.files("cloudless.ir").joinpath("schemas", f"{name}.schema.json").read_text()
    return json.loads(text)


def validate(document: Any, schema_name: str, source: str = "<document>") -> None:
    """Raise SchemaError naming `source` and the first offending key path if `document` is invalid."""
    validator = jsonschema.Draft202012Validator(load_schema(schema_name))
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    if errors:
        error = errors[0]
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise SchemaError(f"{source}: key {where}: {error.message}")


#: user-written YAML (catalogs, hand-edited manifests) is small; anything larger is refused unread
MAX_YAML_BYTES = 4 * 2**20


def read_yaml(text: str, source: str) -> Any:
    """Parse user-written YAML safely: no aliases (an alias bomb expands a few lines into gigabytes)
    and at most MAX_YAML_BYTES; SchemaError naming `source` (and the line) otherwise."""
    import yaml  # the IR modules the functions ship (workflow, protocol, schedule) stay free of it

    if len(text) > MAX_YAML_BYTES:
        raise SchemaError(f"{source}: {len(text):,} characters; a YAML file here holds at most {MAX_YAML_BYTES:,}")
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                line = event.start_mark.line + 1 if event.start_mark else 0
                raise SchemaError(f"{source}:{line}: YAML aliases (*name) are not accepted; write the value out")
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise SchemaError(f"{source}{line}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from exc


def check_finite(document: Any, source: str, where: str = "") -> None:
    """SchemaError naming the key of the first number that is NaN or infinite (YAML's .nan, .inf)."""
    if isinstance(document, float) and not math.isfinite(document):
        raise SchemaError(f"{source}: key {where or '(top level)'}: {document}; expected a finite number")
    if isinstance(document, dict):
        for key, value in document.items():
            check_finite(value, source, f"{where}/{key}" if where else str(key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            check_finite(value, source, f"{where}/{index}" if where else str(index))
