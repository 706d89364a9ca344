"""Admission at session open, driven by a concurrency limit updated once per control interval.

Owns the interval's samples, the decision for each new session, and the counters. Admitted
sessions are never evicted to make room: a cut of the cap only refuses newcomers until
enough sessions have left. Time comes from the caller (`now_s`) and interval ticks from the
runtime's scheduler, so it runs the same on the virtual and the wall clock.

Two guards beside the limit:
* the memory ceiling (`memory_ceiling`): how many sessions of the server's bound the KV pool
  holds at their peak. It is a fact of memory, not of load, so it binds whatever the limit
  says (refusal reason `kv_memory`).
* frames judged by their own session (`admission.pacing`): a frame whose session queued
  more input than one engine step processes for a session (`self_paced_tokens`), or sends
  input faster than real time so that the frame queued behind its own previous one
  (`frame_period_s`), is late because of its own session, not because the server is
  loaded. Such frames are counted (`CapSample.self_paced`) but are no signal, so one client
  flooding its own session cannot cut the cap and close the server to everyone else; what
  its flood does to other sessions' frames still shows in theirs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.admission.limits import ConcurrencyLimit, IntervalSample
from metronome.admission.pacing import SelfPacing
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
    self_paced: int = 0  # frames left out of the signal: late by their own session's input
    memory_ceiling: int | None = None


@dataclass
class AdmissionController:
    limit: ConcurrencyLimit
    active_sessions: Callable[[], int]
    interval_s: float = 2.0  # ~2 frames per session at 1 s frames: a p95 over enough samples
    on_update: Callable[[CapSample], None] | None = None
    memory_ceiling: int | None = None  # sessions the KV pool holds at their peak; None: any
    self_paced_tokens: int | None = None  # None: a frame's size is never held against it
    frame_period_s: float | None = None  # None: its session's pace is never held against it
    history: list[CapSample] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # admitted / refused:<reason>
    _fractions: list[float] = field(default_factory=list)
    _misses: int = 0
    _stalled: int = 0
    _self_paced: int = 0
    _active_sum: int = 0  # active sessions summed over the interval's signal frames

    def __post_init__(self) -> None:
        self.pacing = SelfPacing(self.self_paced_tokens, self.frame_period_s)

    def start(self, timer: Timer, at_s: float = 0.0) -> None:
        """Tick every interval on the runtime's timer, from `at_s` on."""
        def tick(now_s: float) -> None:
            self.end_interval(now_s)
            timer.call_at(now_s + self.interval_s, tick)

        timer.call_at(at_s + self.interval_s, tick)

    @property
    def effective_cap(self) -> int:
        """Sessions admitted now: the limit's cap, within the memory ceiling."""
        ceiling = self.memory_ceiling
        return self.limit.cap if ceiling is None else min(self.limit.cap, ceiling)

    def try_admit(self, now_s: float) -> Decision:
        active = self.active_sessions()
        if self.memory_ceiling is not None and active >= self.memory_ceiling:
            return self._refuse("kv_memory")
        if active >= self.limit.cap:
            return self._refuse("at_capacity")
        self.counts["admitted"] += 1
        return Decision(True)

    def _refuse(self, reason: str) -> Decision:
        self.counts[f"refused:{reason}"] += 1
        return Decision(False, reason, retry_after_s=self.interval_s)

    def on_result(self, result: FrameResult) -> None:
        """Feed every frame result (a runtime listener); frames that never reach the engine
        are no signal."""
        if result.status in (FrameStatus.REJECTED, FrameStatus.CANCELLED):
            return
        self_paced = self.pacing.judge(result)
        if result.status is not FrameStatus.STALLED_KV and self_paced:
            self._self_paced += 1
            return
        self._fractions.append(result.latency_fraction)
        self._active_sum += self.active_sessions()
        self._misses += not result.deadline_met
        self._stalled += result.status is FrameStatus.STALLED_KV

    def end_interval(self, now_s: float) -> int:
        frames = len(self._fractions)
        sample = IntervalSample(self._fractions, self._misses, self._stalled,
                                self.active_sessions(),
                                self._active_sum / frames if frames else None)
        q = self.limit.percentile
        cap = self.limit.update(sample)
        record = CapSample(now_s, cap, sample.active_sessions, sample.percentile(q), q,
                           sample.num_frames, sample.deadline_misses, sample.stalled_frames,
                           self._self_paced, self.memory_ceiling)
        self.history.append(record)
        if self.on_update is not None:
            self.on_update(record)
        self._fractions, self._misses, self._stalled, self._self_paced = [], 0, 0, 0
        self._active_sum = 0
        self.pacing.forget_before(now_s - self.interval_s)
        return cap
