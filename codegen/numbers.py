"""Numbers as the report and its pictures print them: a fixed number of significant digits, never an
exponent, so that the same figures always give the same text."""

from __future__ import annotations

import math


def fmt(value: float | None, digits: int = 4) -> str:
    """`digits` significant digits in plain decimal notation (never exponent), for stable text."""
    if value is None or not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    decimals = max(0, min(10, digits - 1 - math.floor(math.log10(abs(value)))))
    return f"{value:.{decimals}f}"


def fmt_s(value: float) -> str:
    return f"{fmt(value)} s"


def fmt_usd(value: float) -> str:
    return f"{fmt(value)} USD"


def fmt_ratio(value: float | None) -> str:
    """A ratio of plan.json; null (a baseline's figure is zero, so no ratio exists) is `n/a`."""
    return "n/a" if value is None or not math.isfinite(value) else f"{fmt(value, 3)}×"
