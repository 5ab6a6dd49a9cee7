"""What every family of build checks shares: the error and its one-line message, reading a build's YAML
and checking it against a schema, and `BuildContext`, the build folder with its manifest (which files are as
compiled, to name the edited one of two that disagree)."""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

import jsonschema
import yaml

from ...ir.files import BUILD_MARKER, digest_of, read_manifest
from ...ir.schema import SchemaError, load_schema

#: Lambda function and state machine names (letters, digits, '-' and '_')
AWS_NAME = re.compile(r"[A-Za-z0-9_-]+")
#: the hint on a message about a file whose digest no longer matches cloudless-build.json
EDITED = " (the file was edited after the compile; recompile)"
MISSING = object()


class BuildCheckError(SchemaError):
    """A generated file is malformed or breaks a platform limit; the message names the file and the key."""


def fail(file: str, key: str, message: str) -> NoReturn:
    """Raise the one-line message `file: key K: message` (a parser's multi-line message is joined)."""
    raise BuildCheckError(" ".join(f"{file}: key {key}: {message}".split()))


def build_relative(build: Path, path: Path) -> str:
    return path.relative_to(build).as_posix()


def load_yaml(build: Path, path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        # Short-form intrinsics (!Ref) fail here too: the project writes them in long form.
        where = ""
        if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
            where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
        problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) and exc.problem else str(exc)
        fail(build_relative(build, path), "(top level)", f"not plain YAML: {problem}{where}")


def schema_check(document: Any, schema_name: str, file: str) -> None:
    """Like cloudless.ir.schema.validate, but the key names the offending entry itself (the unknown key, the
    bad property name), not only the object holding it."""
    validator = jsonschema.Draft202012Validator(load_schema(schema_name))
    errors = sorted(validator.iter_errors(document), key=lambda e: [str(p) for p in e.absolute_path])
    if not errors:
        return
    error = errors[0]
    path = [str(p) for p in error.absolute_path]
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(error.schema.get("properties", {}))
        patterns = list(error.schema.get("patternProperties", {}))
        extra = sorted(k for k in error.instance if k not in allowed and not any(re.search(p, k) for p in patterns))
        if extra:
            path.append(str(extra[0]))
    elif "propertyNames" in error.schema_path:
        path.append(str(error.instance))
    fail(file, "/".join(path) or "(top level)", error.message)


class BuildContext:
    """A build folder and its manifest: which files are as compiled (their digests, each computed once),
    and the compiled workflow (an intact function.json's copy), to tell which of two disagreeing values
    was edited. Without a manifest (`check_deployment`) nothing counts as edited."""

    def __init__(self, root: Path, manifest: dict[str, str] | None) -> None:
        self.root, self.manifest = root, manifest or {}
        self._digests: dict[str, str | None] = {}
        self._compiled: Any = MISSING

    @classmethod
    def open(cls, root: Path) -> BuildContext:
        if not (root / BUILD_MARKER).is_file():
            fail(
                BUILD_MARKER,
                "(file)",
                "missing: not a build written by cloudless-compile, or written by an older version; recompile",
            )
        manifest = read_manifest(root)
        if manifest is None:
            fail(BUILD_MARKER, "(top level)", 'not JSON of kind "cloudless-build" with "files"; recompile')
        for path, digest in manifest.items():
            parts = PurePosixPath(path).parts
            if PurePosixPath(path).is_absolute() or ".." in parts or not parts:
                fail(BUILD_MARKER, f"files/{path}", "not a path inside the build folder")
            if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                fail(BUILD_MARKER, f"files/{path}", f"{shorten(digest)} is not sha256:<64 hex digits>")
        return cls(root, manifest)

    def digest(self, path: str) -> str | None:
        """The file's digest now; None if it is not there."""
        if path not in self._digests:
            self._digests[path] = digest_of(self.root / path)  # as cloudless-run checks it
        return self._digests[path]

    def edited(self, path: str) -> bool:
        """Listed in the manifest, but missing or with other bytes."""
        return path in self.manifest and self.digest(path) != self.manifest[path]

    def culprit(self, default: str, other: str) -> str:
        """Of two files that disagree, the one to name: `other` when only it was edited, else `default`."""
        return other if self.edited(other) and not self.edited(default) else default

    def note(self, path: str) -> str:
        return EDITED if self.edited(path) else ""

    @property
    def compiled(self) -> Any:
        """The workflow document as compiled: the copy in the first intact function.json (None if none is)."""
        if self._compiled is MISSING:
            self._compiled = None
            for path in sorted(p for p in self.manifest if p.endswith("/function.json")):
                if not self.edited(path):
                    try:
                        self._compiled = json.loads((self.root / path).read_text())["workflow"]
                    except (OSError, ValueError, KeyError, TypeError):
                        continue
                    break
        return self._compiled

    def blame(self, keys: list[str]) -> str:
        """Of workflow.yaml's keys that disagree with each other, the first whose value is not as compiled
        (the first when that cannot be told)."""
        if self.edited("workflow.yaml") and self.compiled is not None:
            document = yaml.safe_load((self.root / "workflow.yaml").read_text())
            for key in keys:
                if lookup(document, key) != lookup(self.compiled, key):
                    return key
        return keys[0]

    def was(self, key: str, value: Any) -> str:
        """`; compiled as X` when workflow.yaml's `key` holds `value` but was compiled otherwise."""
        if not self.edited("workflow.yaml") or self.compiled is None:
            return ""
        compiled = lookup(self.compiled, key)
        if compiled is MISSING or compiled == value:
            return ""
        return f"; compiled as {shorten(compiled)}{EDITED}"


def lookup(document: Any, key: str) -> Any:
    """The value at a key path like `regions/0/functions/1/inputs`; MISSING if there is none."""
    for part in key.split("/"):
        if isinstance(document, dict) and part in document:
            document = document[part]
        elif isinstance(document, list) and part.isdigit() and int(part) < len(document):
            document = document[int(part)]
        else:
            return MISSING
    return document


def shorten(value: Any, limit: int = 80) -> str:
    text = "(nothing)" if value is MISSING else repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
