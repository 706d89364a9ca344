"""Admission at session open, driven by a concurrency limit updated once per control interval.

Owns the interval's samples, the decision for each new session, and the counters. Admitted
sessions are never evicted to make room: a cut of the cap only refuses newcomers until
enough sessions have left. Time comes from the caller (`now_s`) and interval ticks from the
runtime's scheduler, so it runs the same on the virtual and the wall clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.admission.limits import ConcurrencyLimit, IntervalSample
from metronome.runtime.frame import FrameResult, FrameStatus
from metronome.runtime.ports import Timer


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str = ""  # protocol-level reason when refused
    retry_after_s: float = 0.0


@dataclass
class CapSample:
    at_s: float
    cap: int
    active_sessions: int
    latency_fraction: float | None  # the limit's percentile of latency / deadline
    percentile: float  # which percentile (95: p95)
    frames: int
    misses: int
    stalled: int


@dataclass
class AdmissionController:
    limit: ConcurrencyLimit
    active_sessions: Callable[[], int]
    interval_s: float = 2.0  # ~2 frames per session at 1 s frames: a p95 over enough samples
    on_update: Callable[[CapSample], None] | None = None
    history: list[CapSample] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # admitted / refused:<reason>
    _fractions: list[float] = field(default_factory=list)
    _misses: int = 0
    _stalled: int = 0

    def start(self, timer: Timer, at_s: float = 0.0) -> None:
        """Tick every interval on the runtime's timer, from `at_s` on."""
        def tick(now_s: float) -> None:
            self.end_interval(now_s)
            timer.call_at(now_s + self.interval_s, tick)

        timer.call_at(at_s + self.interval_s, tick)

    def try_admit(self, now_s: float) -> Decision:
        if self.active_sessions() < self.limit.cap:
            self.counts["admitted"] += 1
            return Decision(True)
        self.counts["refused:at_capacity"] += 1
        return Decision(False, "at_capacity", retry_after_s=self.interval_s)

    def on_result(self, result: FrameResult) -> None:
        """Feed every frame result (a runtime listener); frames that never reach the engine
        are no signal."""
        if result.status in (FrameStatus.REJECTED, FrameStatus.CANCELLED):
            return
        self._fractions.append(result.latency_fraction)
        self._misses += not result.deadline_met
        self._stalled += result.status is FrameStatus.STALLED_KV

    def end_interval(self, now_s: float) -> int:
        sample = IntervalSample(self._fractions, self._misses, self._stalled,
                                self.active_sessions())
        q = self.limit.percentile
        cap = self.limit.update(sample)
        record = CapSample(now_s, cap, sample.active_sessions, sample.percentile(q), q,
                           sample.num_frames, sample.deadline_misses, sample.stalled_frames)
        self.history.append(record)
        if self.on_update is not None:
            self.on_update(record)
        self._fractions, self._misses, self._stalled = [], 0, 0
        return cap
