"""The one step timer: systems measured side by side, their steps interleaved.

    times = interleave({"ours": ours, "vllm": theirs}, rounds=5, steps=3)
    stats(times["ours"])   # median_ms (of the rounds' medians), min_ms, p95_ms, ...

A system is a callable (its step: timed) or an object with `step()` and, if it needs one,
`prepare()`: untimed work before each step (feeding an engine its next input, opening a
socket). Every system first takes `warmup` untimed steps; then, in each of `rounds` rounds,
each system takes `steps` timed steps in turn, the order rotating by one every round (on a
shared machine, load from elsewhere hits every system alike; `rotate=False` keeps the order
given, for stages that depend on the one before). `around(name)`, if given, is a context
manager entered (untimed) around each system's steps of a round: a reading beside each.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass


@dataclass
class Steps:
    """A step with untimed work before it."""

    step: Callable[[], object]
    prepare: Callable[[], object] | None = None


def interleave(systems: Mapping[str, object], rounds: int, steps: int = 1, warmup: int = 1,
               rotate: bool = True,
               around: Callable[[str], AbstractContextManager] | None = None,
               ) -> dict[str, list[list[float]]]:
    """Seconds of every timed step: {system: [round: [step, ...], ...]}."""
    names = list(systems)
    step = {n: getattr(s, "step", s) for n, s in systems.items()}
    prepare = {n: getattr(s, "prepare", None) or (lambda: None) for n, s in systems.items()}
    for _ in range(warmup):
        for name in names:
            prepare[name]()
            step[name]()
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names) if rotate else 0
        for name in names[k:] + names[:k]:
            block = []
            with around(name) if around else nullcontext():
                for _ in range(steps):
                    prepare[name]()
                    started = time.perf_counter()
                    step[name]()
                    block.append(time.perf_counter() - started)
            times[name].append(block)
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
