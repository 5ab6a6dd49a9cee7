"""plan.json: the chosen plan, its predicted time and cost, the solver's proof, and every baseline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cloudless.ir.graph import dumps
from cloudless.ir.schema import validate


def save_plan(document: dict[str, Any], path: Path) -> None:
    validate(document, "plan", str(path))
    path.write_text(dumps(document))


def load_plan(path: Path) -> dict[str, Any]:
    document = json.loads(path.read_text())
    validate(document, "plan", str(path))
    return document
