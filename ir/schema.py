"""JSON Schemas of the IR files, shipped as package data, and one validation entry point."""

from __future__ import annotations

import json
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
