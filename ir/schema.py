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
    schema: dict[str, Any] = json.loads(text)
    return schema


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
#: how deeply mappings and lists may nest: ours need 5 levels; deeper costs the parser quadratic time
#: and the composer its recursion limit
MAX_YAML_DEPTH = 32
#: no figure of a catalog or manifest is larger; beyond, arithmetic on it overflows a float
MAX_MAGNITUDE = 1e300


@cache
def _unique_key_loader() -> Any:
    """yaml's SafeLoader, refusing a key given twice in one mapping (YAML keeps the last, silently:
    a catalog's price typed twice would take the second). SchemaError's source is filled in by read_yaml."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                first: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # `<<:` merges a mapping in; its keys may be overridden
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        if key in first:
                            raise _DuplicateKey(f"{line}: key {key!r} given twice (first at line {first[key]})")
                        first[key] = line
                    except TypeError:  # an unhashable key: the constructor's own error names it
                        continue
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


class _DuplicateKey(Exception):
    """`LINE: key K given twice (first at line L)`, before read_yaml names the file."""


def read_yaml(text: str, source: str) -> Any:
    """Parse user-written YAML safely: no aliases (an alias bomb expands a few lines into gigabytes),
    no key given twice in one mapping, and at most MAX_YAML_BYTES; SchemaError naming `source` (and the
    line) otherwise."""
    import yaml  # the IR modules the functions ship (workflow, protocol, schedule) stay free of it

    if len(text) > MAX_YAML_BYTES:
        raise SchemaError(f"{source}: {len(text):,} characters; a YAML file here holds at most {MAX_YAML_BYTES:,}")
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            line = event.start_mark.line + 1 if event.start_mark else 0
            if isinstance(event, yaml.AliasEvent):
                raise SchemaError(f"{source}:{line}: YAML aliases (*name) are not accepted; write the value out")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise SchemaError(f"{source}:{line}: nested more than {MAX_YAML_DEPTH} levels deep")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        return yaml.load(text, Loader=_unique_key_loader())  # a SafeLoader: builds no Python objects
    except _DuplicateKey as exc:
        raise SchemaError(f"{source}:{exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        raise SchemaError(f"{source}{line}: not valid YAML: {problem}") from exc
    except SchemaError:
        raise
    except ValueError as exc:  # an integer of more digits than Python converts
        why = str(exc).strip().splitlines()[0].split(";")[0]
        raise SchemaError(f"{source}: a number cannot be read: {why}") from exc


def check_finite(document: Any, source: str, where: str = "") -> None:
    """SchemaError naming the key of the first number that is NaN or infinite (YAML's .nan, .inf),
    or larger than MAX_MAGNITUDE."""
    if isinstance(document, float) and not math.isfinite(document):
        raise SchemaError(f"{source}: key {where or '(top level)'}: {document}; expected a finite number")
    if isinstance(document, int | float) and abs(document) > MAX_MAGNITUDE:
        shown = f"{document:.3g}" if isinstance(document, float) else f"an integer of {len(str(abs(document)))} digits"
        raise SchemaError(f"{source}: key {where or '(top level)'}: {shown}; expected at most {MAX_MAGNITUDE:g}")
    if isinstance(document, dict):
        for key, value in document.items():
            check_finite(value, source, f"{where}/{key}" if where else str(key))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            check_finite(value, source, f"{where}/{index}" if where else str(index))
