"""The default lane's list of cases left to the slow lane (conftest.SLOW_CASES) names tests that exist: a
renamed test would otherwise come back to the default lane unnoticed."""

from __future__ import annotations

import re

from tests.conftest import ROOT, SLOW_CASES


def test_every_slow_case_names_a_test_function() -> None:
    missing = []
    for case in sorted(SLOW_CASES):
        path, _, name = case.partition("::")
        function = re.sub(r"\[.*\]$", "", name)
        file = ROOT / path
        if not file.is_file() or not re.search(rf"^def {re.escape(function)}\(", file.read_text(), re.M):
            missing.append(case)
    assert missing == []
