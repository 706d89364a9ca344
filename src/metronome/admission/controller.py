"""Admission at session open, driven by a concurrency limit updated once per control interval.

Owns the interval's samples, the decision for each new session, and the counters. Admitted
sessions are never evicted to make room: a cut of the cap only refuses newcomers until
enough sessions have left. Time comes from the caller (`now_s`) and interval ticks from the
runtime's scheduler, so it runs the same on the virtual and the wall clock.

Three guards beside the limit:
* the memory ceiling (`memory_ceiling`): how many sessions of the server's bound the KV pool
  holds at their peak. It is a fact of memory, not of load, so it binds whatever the limit
  says (refusal reason `kv_memory`).
* frames judged by their own session (`admission.pacing`): a frame whose session queued
  more input than one engine step processes for a session (`self_paced_tokens`), or sends
  input faster than real time so that the frame queued behind its own previous one
  (`frame_period_s`), is late because of its own session, not because the server is
  loaded. Such frames are counted (`CapSample.self_paced`) but are no signal, so one client
  flooding its own session cannot cut the cap and close the server to everyone else.
* work out of proportion (`steered_work_factor`): what a flood does to the others' frames is the
  flooder's, not the session count's. Each engine step reports the input positions it processed
  per session (`on_step`); when the sessions whose latest frame was self-paced did, each on
  average, more than `steered_work_factor` x the average work of the interval's other working
  sessions, the interval says how far a few clients' input went, not how many sessions fit
  (`IntervalSample.steered`): over target, the limit holds the cap instead of cutting it; under
  target it grows as ever (the load it carried, floods and all, was fine). A real server showed
  why: one client appending audio at 6x real time and one flooding ~630-token text items beside 3
  real-time streamers did ~90 % of the engine's work; the streamers' frames went from ~0.2 s to
  0.8-1.0 s of their 1 s deadline, and the cap fell 8 -> 4 in 4 intervals (1 s each) with 2-4 of
  10 new users refused (tests/serve/test_serve_attack_admission.py). A cut cannot undo that
  (admitted sessions are never evicted, and a new real-time session adds one fair share); a
  workload whose sessions all send large input (a chat server of long items) is no one's
  disproportion and is cut as usual.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.admission.limits import ConcurrencyLimit, IntervalSample
from metronome.admission.pacing import SelfPacing
from metronome.engine.types import StepOutput
from metronome.runtime.ports import Timer
from metronome.stream import Frame, FrameStatus


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
    self_paced_work_share: float | None = None  # of the engine's work; None: no self-paced
    steered: bool = False  # that share was out of proportion: over target, the cap held
    output_gaps: int = 0  # replies' listeners that ran dry (each a miss)
    input_behind: int = 0  # real-time audio chunks kept past the buffer bound (each a miss)


@dataclass
class AdmissionController:
    limit: ConcurrencyLimit
    active_sessions: Callable[[], int]
    interval_s: float = 2.0  # ~2 frames per session at 1 s frames: a p95 over enough samples
    on_update: Callable[[CapSample], None] | None = None
    memory_ceiling: int | None = None  # sessions the KV pool holds at their peak; None: any
    self_paced_tokens: int | None = None  # None: a frame's size is never held against it
    frame_period_s: float | None = None  # None: its session's pace is never held against it
    # self-paced sessions' work per session over this multiple of the other working sessions'
    # holds the cap (2: one flooder among 3 streamers holds it from 2/5 of the work on)
    steered_work_factor: float = 2.0
    history: list[CapSample] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)  # admitted / refused:<reason>
    _fractions: list[float] = field(default_factory=list)
    _misses: int = 0
    _stalled: int = 0
    _self_paced: int = 0
    _output_gaps: int = 0
    _input_behind: int = 0
    _active_sum: int = 0  # active sessions summed over the interval's signal frames
    _work_tokens: Counter = field(default_factory=Counter)  # session id -> input positions

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

    def on_result(self, result: Frame) -> None:
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

    def on_output_gap(self, gap_s: float) -> None:
        """A reply's listener ran dry for `gap_s` (`serve.realtime.pacing`): the output
        stream's deadline was missed, a miss of the interval as a late frame's is (a reply
        is paced by the server alone, so no client's pace excuses it)."""
        assert gap_s > 0, gap_s
        self._output_gaps += 1

    def on_input_behind(self) -> None:
        """A chunk of audio sent at real time was kept past the session's buffer bound
        (`serve.realtime.intake`): the server is behind its input, a miss of the interval
        (the client's pace is not the cause: audio ahead of real time is refused instead)."""
        self._input_behind += 1

    def on_step(self, out: StepOutput) -> None:
        """Count each session's engine work this interval: input positions processed (its
        input and its fed-back output tokens)."""
        for session_id, tokens in out.input_tokens.items():
            self._work_tokens[session_id] += tokens

    def _steered(self) -> tuple[float | None, bool]:
        """The interval's engine work done for self-paced sessions (those whose latest frame
        was judged self-paced: a flood of long items answers a frame only every few
        intervals; None: none worked), and whether each did more than `steered_work_factor`
        x the work of each other working session (means per session)."""
        working = [sid for sid, tokens in self._work_tokens.items() if tokens]
        self_paced = [sid for sid in working if self.pacing.latest(sid)]
        if not self_paced:
            return None, False
        paced_tokens = sum(self._work_tokens[sid] for sid in self_paced)
        total_tokens = self._work_tokens.total()
        share = paced_tokens / total_tokens
        others = len(working) - len(self_paced)
        if not others:  # every working session sends large input: no one's disproportion
            return share, False
        # per session, against the others' (not against an average that holds their own work:
        # that bound reaches 1 at half the sessions, and 2 floods of 6 read 0.63-0.77 of the
        # work against a 0.67 bar, steered in one run and not in the next)
        paced_per_session = paced_tokens / len(self_paced)
        other_per_session = (total_tokens - paced_tokens) / others
        return share, paced_per_session > self.steered_work_factor * other_per_session

    def end_interval(self, now_s: float) -> int:
        frames = len(self._fractions)
        work_share, steered = self._steered()
        sample = IntervalSample(self._fractions, self._misses, self._stalled,
                                self.active_sessions(),
                                self._active_sum / frames if frames else None, steered,
                                self._output_gaps, self._input_behind)
        q = self.limit.percentile
        cap = self.limit.update(sample)
        record = CapSample(now_s, cap, sample.active_sessions, sample.percentile(q), q,
                           sample.num_frames, sample.deadline_misses, sample.stalled_frames,
                           self._self_paced, self.memory_ceiling, work_share, steered,
                           self._output_gaps, self._input_behind)
        self.history.append(record)
        if self.on_update is not None:
            self.on_update(record)
        self._fractions, self._misses, self._stalled, self._self_paced = [], 0, 0, 0
        self._output_gaps = self._input_behind = 0
        self._active_sum = 0
        self.pacing.forget_before(now_s - self.interval_s, keep=self._work_tokens.keys())
        self._work_tokens = Counter()
        return cap
