"""The one step timer: `interleave({"ours": a, "vllm": b}, rounds=5, steps=3)`, then
`stats(times["ours"])`. A system is a callable (its step, timed) or an object with `step()`
and, if it needs one, `prepare()` (untimed work before each step). Each first takes `warmup`
untimed steps; then each round each takes `steps` timed steps in turn, the order rotating
by one a round (load from elsewhere hits every system alike). `around(name)`: a context
manager around a system's steps of a round (a reading beside each).
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import nullcontext


def interleave(systems: dict, rounds: int, steps: int = 1, warmup: int = 1,
               around=None) -> dict[str, list[list[float]]]:
    """Seconds of every timed step: {system: [round: [step, ...], ...]}."""
    names = list(systems)
    step = {n: getattr(s, "step", s) for n, s in systems.items()}
    prepare = {n: getattr(s, "prepare", lambda: None) for n, s in systems.items()}
    for _ in range(warmup):
        for name in names:
            prepare[name]()
            step[name]()
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append([])
            with around(name) if around else nullcontext():
                for _ in range(steps):
                    prepare[name]()
                    started = time.perf_counter()
                    step[name]()
                    times[name][-1].append(time.perf_counter() - started)
    return times


def stats(rounds: list[list[float]]) -> dict:
    """One system's times (seconds, per round) in ms: the median of the rounds' medians (a
    round hit by a burst of load moves it by one place), the fastest step, p95, mean."""
    flat = sorted(s * 1e3 for r in rounds for s in r)
    medians = [statistics.median(r) * 1e3 for r in rounds]
    return {"median_ms": statistics.median(medians), "min_ms": flat[0],
            "p95_ms": flat[math.ceil(0.95 * len(flat)) - 1], "mean_ms": statistics.fmean(flat),
            "round_medians_ms": medians, "n": len(flat)}


def geomean(values: list[float]) -> float | None:
    return math.exp(statistics.fmean(map(math.log, values))) if values else None
