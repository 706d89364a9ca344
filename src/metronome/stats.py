"""Statistics every layer shares: one definition of a percentile (the recorder's summaries,
the N* sweep, the admission controller's signal and the load generator all use it)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile: the value at rank ceil(q/100 x n) of the sorted values;
    None for no values. `q` in (0, 100]."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile q must be in (0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
