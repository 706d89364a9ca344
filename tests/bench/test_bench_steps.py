"""The one step timer: its order (warm-up, then rounds whose order rotates), what it times
(the step, never `prepare`), the reading around each round, and the statistics."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

from metronome.bench.steps import geomean, interleave, stats


class Recorder:
    def __init__(self, name: str, calls: list, step_s: float = 0.0, prepare_s: float = 0.0):
        self.name, self.calls, self.step_s, self.prepare_s = name, calls, step_s, prepare_s

    def prepare(self) -> None:
        self.calls.append(("prepare", self.name))
        time.sleep(self.prepare_s)

    def step(self) -> None:
        self.calls.append(("step", self.name))
        time.sleep(self.step_s)


def test_warm_up_first_then_rounds_whose_order_rotates():
    calls: list = []
    times = interleave({n: lambda n=n: calls.append(n) for n in "abc"}, rounds=4, steps=2,
                       warmup=1)
    assert calls == list("abc") + list("aabbcc") + list("bbccaa") + list("ccaabb") + list(
        "aabbcc")
    assert {n: [len(r) for r in t] for n, t in times.items()} == {n: [2] * 4 for n in "abc"}


def test_prepare_runs_before_every_step_and_is_not_timed():
    calls: list = []
    slow_prepare = Recorder("x", calls, step_s=0.001, prepare_s=0.05)
    times = interleave({"x": slow_prepare}, rounds=2, steps=2, warmup=0)
    assert calls == [("prepare", "x"), ("step", "x")] * 4
    assert all(0.001 <= s < 0.04 for r in times["x"] for s in r)


def test_around_wraps_each_systems_steps_of_a_round_untimed():
    calls: list = []

    @contextmanager
    def around(name: str):
        calls.append(("enter", name))
        time.sleep(0.05)
        yield
        calls.append(("exit", name))

    times = interleave({n: Recorder(n, calls) for n in "ab"}, rounds=2, warmup=1,
                       around=around)
    steps = [("prepare", "a"), ("step", "a")]
    assert calls[:4] == steps + [("prepare", "b"), ("step", "b")]  # warm-up: no reading
    assert calls[4:] == [("enter", "a"), *steps, ("exit", "a"),
                         ("enter", "b"), ("prepare", "b"), ("step", "b"), ("exit", "b"),
                         ("enter", "b"), ("prepare", "b"), ("step", "b"), ("exit", "b"),
                         ("enter", "a"), *steps, ("exit", "a")]
    assert all(s < 0.04 for t in times.values() for r in t for s in r)


def test_stats_take_the_median_of_the_rounds_medians():
    rounds = [[0.010, 0.030, 0.020], [0.100, 0.100, 0.100], [0.001, 0.002, 0.003]]
    s = stats(rounds)
    assert s["round_medians_ms"] == pytest.approx([20.0, 100.0, 2.0])
    assert s["median_ms"] == pytest.approx(20.0)
    assert s["min_ms"] == pytest.approx(1.0)
    assert s["p95_ms"] == pytest.approx(100.0)  # the 9th of 9
    assert s["mean_ms"] == pytest.approx(sum(map(sum, rounds)) * 1e3 / 9)
    assert s["n"] == 9
    assert stats([[0.004]] * 20)["p95_ms"] == pytest.approx(4.0)


def test_geomean():
    assert geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert geomean([]) is None
