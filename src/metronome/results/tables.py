"""Numbers as report text: one cell formatter and one markdown table."""

from __future__ import annotations

import math
from collections.abc import Sequence


def fmt(value, spec: str = ".3g") -> str:
    """A table cell: '-' for None (not measured, or not applicable)."""
    return "-" if value is None else format(value, spec)


def ms(seconds: float | None, spec: str = ".1f") -> str:
    """Seconds shown as milliseconds."""
    return fmt(None if seconds is None else seconds * 1e3, spec)


def ratio(num: float | None, den: float | None, spec: str = ".2f") -> str:
    """num / den as 'N.NNx'; '-' when either is missing or den is 0."""
    if num is None or not den:
        return "-"
    return format(num / den, spec) + "x"


def pct(share: float | None, spec: str = ".1f") -> str:
    """A share as a percentage ('12.3 %'); '-' when missing or NaN."""
    if share is None or math.isnan(share):
        return "-"
    return format(100 * share, spec) + " %"


def times(value: float | None, spec: str = ".2f") -> str:
    """A ratio already divided, as 'N.NN×'; '-' when missing or NaN."""
    if value is None or math.isnan(value):
        return "-"
    return format(value, spec) + "×"


def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A markdown table; cells are str() of what they are given (format them first)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
