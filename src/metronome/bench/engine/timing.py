"""Timing primitives: one timed call, steps interleaved round-robin, and their statistics."""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable

from metronome.bench.engine.plan import Key


def timed_call(fn: Callable[[], object]) -> tuple[float, float, float, int]:
    """(wall ms, user CPU s, system CPU s, minor page faults) of one call."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    fn()
    wall_ms = (time.perf_counter() - start) * 1e3
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (wall_ms, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
            after.ru_minflt - before.ru_minflt)


def time_interleaved(steps: dict[Key, Callable[[], object]], warmup: int,
                     repeats: int) -> dict[Key, dict]:
    """Warm up, then time `repeats` steps of each, round-robin (start rotates every round)."""
    keys = list(steps)
    for _ in range(warmup):
        for key in keys:
            steps[key]()
    calls: dict[Key, list[tuple]] = {key: [] for key in keys}
    for i in range(repeats):
        for key in keys[i % len(keys):] + keys[: i % len(keys)]:
            calls[key].append(timed_call(steps[key]))
    return {key: timing_stats(calls[key]) for key in keys}


def timing_stats(calls: list[tuple]) -> dict:
    step_ms = [c[0] for c in calls]
    user_s, sys_s = sum(c[1] for c in calls), sum(c[2] for c in calls)
    return {
        "step_ms": step_ms,
        "step_ms_min": min(step_ms),
        "step_ms_median": statistics.median(step_ms),
        "cpu_sys_share": sys_s / max(user_s + sys_s, 1e-9),
        "minor_faults_per_step": sum(c[3] for c in calls) / len(calls),
        "load_avg_1m": os.getloadavg()[0],
    }
