"""Searching for the largest N that passes a monotone test (the N* sweeps)."""

from __future__ import annotations

from collections.abc import Callable


def largest_passing(ok: Callable[[int], bool], n_max: int) -> int:
    """Largest n in [0, n_max] with ok(n), for ok true up to some n and false beyond:
    doubling, then bisection (O(log n) calls)."""
    lo, hi = 0, 1
    while hi <= n_max and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, n_max + 1)
    while hi - lo > 1:  # invariant: ok(lo) (or lo == 0), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
