"""Concurrency limits: how many sessions may be active now. Pure update rules, no clock.

Each limit has a `cap` and one `update(sample)` per control interval. The signal is the
interval's per-frame latency normalised by each frame's deadline (so sessions with
different periods share one scale), plus deadline misses and KV stalls.

AIMD (`AIMDLimit`; `aimd`, the default, is `SlowStartLimit`: this rule after a slow start
that reaches N* in a few intervals), after Netflix concurrency-limits' AIMDLimit and TCP:
* over target (p95 of latency/deadline > `target_fraction`, or any miss, or any
  `stalled_kv` frame): `cap = max(min_cap, floor(cap * decrease))` -- unless more sessions
  are active than the cap allows, in which case the last cut has not taken effect yet and
  the cap holds. Admitted sessions are never evicted, so a cut bites only as sessions leave;
  cutting again on every interval of that lag drove the cap from N* = 16 down to 1 and back
  in a measured run (an oscillation of 1..21). TCP likewise cuts once per round trip.
  A `steered` interval (a few sessions flooding their own input did most of its work) holds
  the cap too: fewer sessions would not have helped;
* under target and the sessions actually press on the cap (`active >= near_cap_fraction *
  cap`): `cap += increase`; an idle cap is not raised, so it cannot drift far above a load it
  has never been tested with;
* no frames in the interval: no signal, no change.
Defaults and why: `decrease = 0.9` and `+1` are Netflix's (gentle cuts keep a large
schedulable N from collapsing on one noisy interval); `target_fraction = 0.8` keeps 20 %
of the deadline as headroom for the sawtooth's overshoot (AIMD probes one step past N*
before it cuts); `near_cap_fraction = 1.0`: raise only a cap that binds. Netflix's 0.5
(`inflight * 2 >= limit`) lets the cap run ahead of a load it has not been tested with; in
the virtual-clock convergence run (N* = 16) it settled 12 % high, 1.0 settled 6 % high.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from metronome.stats import percentile


@dataclass(frozen=True)
class IntervalSample:
    """What one control interval saw."""

    latency_fractions: list[float]  # per finished frame: latency_s / deadline_s
    deadline_misses: int
    stalled_frames: int
    active_sessions: int  # at the interval's end
    mean_active_sessions: float | None = None  # over its frames; None: not measured
    # most of its engine work was a few self-paced sessions' (`admission.controller`): its
    # latency says how far their input went, not how many sessions fit
    steered: bool = False
    # replies' listeners that ran dry (`serve.realtime.pacing`): an output stream's missed
    # deadlines, each a miss as a frame's is
    output_gaps: int = 0
    # chunks of audio sent at real time kept past the buffer bound (`serve.realtime.intake`):
    # the server is behind its input, each a miss as a late frame is
    input_behind: int = 0

    @property
    def signals(self) -> bool:
        """It saw a frame finish, a listener run dry or input wait: something to act on."""
        return bool(self.latency_fractions) or self.output_gaps > 0 or self.input_behind > 0

    @property
    def stream_misses(self) -> int:
        """Misses of the sessions' streams outside frames: output gaps and input behind."""
        return self.output_gaps + self.input_behind

    @property
    def load(self) -> float:
        """Sessions that produced the interval's latency: the mean over its frames."""
        mean = self.mean_active_sessions
        return self.active_sessions if mean is None else mean

    @property
    def num_frames(self) -> int:
        return len(self.latency_fractions)

    def percentile(self, q: float) -> float | None:
        """The q-th percentile of latency / deadline; None when no frame finished."""
        return percentile(self.latency_fractions, q)


class ConcurrencyLimit(Protocol):
    # the latency percentile the limit acts on (also what is recorded and exported)
    percentile: float

    @property
    def cap(self) -> int: ...

    def update(self, sample: IntervalSample) -> int: ...


@dataclass
class AIMDLimit:
    initial_cap: int = 4
    min_cap: int = 1
    max_cap: int = 4096
    increase: int = 1
    decrease: float = 0.9
    target_fraction: float = 0.8
    percentile: float = 95.0
    near_cap_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_cap <= self.initial_cap <= self.max_cap:
            raise ValueError(f"need 1 <= min_cap <= initial_cap <= max_cap, got min_cap="
                             f"{self.min_cap}, initial_cap={self.initial_cap}, "
                             f"max_cap={self.max_cap}")
        if not 0 < self.decrease < 1 or self.increase < 1:
            raise ValueError(f"need 0 < decrease < 1 and increase >= 1, got decrease="
                             f"{self.decrease}, increase={self.increase}")
        if not (self.target_fraction > 0 and 0 < self.percentile <= 100):
            raise ValueError(f"need target_fraction > 0 and percentile in (0, 100], got "
                             f"target_fraction={self.target_fraction}, "
                             f"percentile={self.percentile}")
        self._cap = self.initial_cap

    @property
    def cap(self) -> int:
        return self._cap

    def over_target(self, sample: IntervalSample) -> bool:
        if sample.deadline_misses or sample.stalled_frames or sample.stream_misses:
            return True
        return sample.percentile(self.percentile) > self.target_fraction

    def update(self, sample: IntervalSample) -> int:
        if not sample.signals:
            return self._cap
        if self.over_target(sample):
            if sample.steered:
                return self._cap
            if sample.active_sessions <= self._cap:  # else: the last cut is still pending
                self._cap = max(self.min_cap, math.floor(self._cap * self.decrease))
        elif sample.active_sessions >= self.near_cap_fraction * self._cap:
            self._cap = min(self.max_cap, self._cap + self.increase)
        return self._cap


@dataclass
class SlowStartLimit(AIMDLimit):
    """AIMD with a slow start, as TCP's: from a cold start the cap reaches N* in a few
    control intervals instead of ~N* (N* = 209 at 2 s intervals: ~7 minutes of refusing
    users the server could serve), then it is `AIMDLimit`.

    * slow start, under target and the cap binding: jump to the N* that the interval's
      latency predicts, at most `growth` x the load that was measured:
          cap = max(cap + increase, floor(n * min(growth, (1 - p0 / T) / (1 - p0 / p))))
      `n`: the interval's mean active sessions (what produced its latency, not the cap),
      `p` its latency percentile, `p0` the lowest seen (an unloaded server's latency, as
      Envoy's minRTT), `T` the target. The ratio is the planner's deadline model fitted to
      one point: latency ~ p0 / (1 - n / M) (a mean step of f / (1 - N w / P)), so the
      interval's (n, p) gives M = n / (1 - p0 / p) and the load at the target is
      M (1 - p0 / T). Far below the target it exceeds `growth` and the cap doubles; near
      the target it tends to 1, so growth slows to +`increase` by itself.
      Measured on the virtual clock from a cap of 4 (N* of 10, 27, 41, 202, 256): 0.9 N*
      within 2-10 intervals, no deadline miss, the run's peak cap 1.03-1.2 N* (the larger
      ratios at small N*: 12 at N* = 10 is AIMD's sawtooth). Growth by
      the headroom instead (x 1 + (growth - 1) h, h = (T - p) / (T - p0)) overshot N* = 41
      to 49 (1.2 x) with 9 % of frames missing; with h**2 it needed 13 intervals at 202.
      Why not start at the planner's N* instead: it is as right as its step cost model.
      On the virtual clock, where that model is the truth, it is within 4 % (plan.md); the
      earlier (Intel) calibration predicted 37 where the real model on the wall clock held
      ~26 (README), and a start 1.4x too high admits sessions that are never evicted. The
      planner's advised start (`--admission-cap`) stays the safe place to begin and rest.
    * the first over-target signal (a miss, a KV stall, or p > T) ends slow start for
      good: the cap is cut as AIMD cuts it and AIMD takes over. Admitted sessions are never
      evicted, so an overshoot lasts until sessions leave; slow start is where one would come
      from, which is why it ends at once.
    * an idle interval (no frames) or one under target with the cap not binding halves the
      gap between a cap below `resting_cap` and it (by default where the cap started: the
      server's `--admission-cap`, which `metronome plan` advises), so a cap cut by a burst
      of misses does not stay low on an idle server (AIMD never raises a cap that does not
      bind: after an attack it stayed at 1 with 0 sessions). A resting cap is one the
      operator vouched for; above it the cap rises only by load that presses on it.
    * misses in at least `severe_miss_fraction` of an interval's frames cut the cap even
      while an earlier cut is pending (AIMD holds then): admitted sessions are being hurt
      now, and the cap must be at the new capacity by the time enough of them leave. A step
      cost that doubled mid-run (N* 41 -> 20) was followed to 1.05 x the new N* in 5
      intervals; holding, AIMD took 9.
    """

    growth: float = 2.0  # the most the cap may multiply the measured load by per interval
    severe_miss_fraction: float = 0.05  # misses this common cut even while a cut is pending
    resting_cap: int | None = None  # where an idle cap returns (a planned N*); None: initial

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.growth <= 1:
            raise ValueError(f"need growth > 1, got {self.growth}")
        if self.resting_cap is not None and not self.min_cap <= self.resting_cap <= self.max_cap:
            raise ValueError(f"need min_cap <= resting_cap <= max_cap, got {self.resting_cap}")
        self.slow_start = True
        self._lowest_fraction: float | None = None  # p0: the lowest latency seen

    def update(self, sample: IntervalSample) -> int:
        if not sample.signals:
            return self._return_to_rest()
        if self.over_target(sample):
            if sample.steered:  # no sign of how many sessions fit: slow start goes on
                return self._cap
            self.slow_start = False
            if self.severe(sample) and sample.active_sessions > self._cap:
                self._cap = max(self.min_cap, math.floor(self._cap * self.decrease))
                return self._cap
            return super().update(sample)
        if sample.active_sessions < self.near_cap_fraction * self._cap:
            return self._return_to_rest()
        if not self.slow_start:
            return super().update(sample)
        p = sample.percentile(self.percentile)
        lowest = self._lowest_fraction
        self._lowest_fraction = p if lowest is None else min(lowest, p)
        # a hair of slack: a prediction that is exactly an integer is not lost to rounding
        grown = math.floor(sample.load * self.predicted_growth(p) + 1e-9)
        self._cap = min(self.max_cap, max(self._cap + self.increase, grown))
        return self._cap

    def _return_to_rest(self) -> int:
        """An idle or non-binding cap below `resting_cap` halves the gap to it."""
        resting = self.initial_cap if self.resting_cap is None else self.resting_cap
        if self._cap < resting:
            self._cap += math.ceil((resting - self._cap) / 2)
        return self._cap

    def severe(self, sample: IntervalSample) -> bool:
        misses = sample.deadline_misses + sample.stream_misses
        return misses >= self.severe_miss_fraction * (sample.num_frames + sample.stream_misses)

    def predicted_growth(self, p: float) -> float:
        """N* over the measured load, as the interval's latency `p` predicts (at most
        `growth`)."""
        p0, target = self._lowest_fraction, self.target_fraction
        if p <= p0:
            return self.growth
        return max(0.0, min(self.growth, (1 - p0 / target) / (1 - p0 / p)))


@dataclass
class StaticLimit:
    """Today's practice: a fixed slot count (Kyutai's "no free channels", max_sessions)."""

    fixed_cap: int
    percentile: float = 95.0  # not acted on: the signal is still recorded for operators

    @property
    def cap(self) -> int:
        return self.fixed_cap

    def update(self, sample: IntervalSample) -> int:
        return self.fixed_cap


class NoLimit:
    """Admission off: every session is admitted."""

    cap = 2**31 - 1
    percentile = 95.0  # not acted on: the signal is still recorded for operators

    def update(self, sample: IntervalSample) -> int:
        return self.cap


def make_limit(kind: str, initial_cap: int = 4, **params) -> ConcurrencyLimit:
    if kind == "aimd":
        return SlowStartLimit(initial_cap=initial_cap, **params)
    if kind == "static":
        return StaticLimit(initial_cap)
    if kind == "off":
        return NoLimit()
    raise ValueError(f"unknown admission controller {kind!r}: aimd | static | off")
