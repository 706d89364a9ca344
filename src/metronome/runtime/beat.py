"""The beat: every frame of every session gets exactly one result, on time, with the truth.

Owns per-session frame queues and the attribution of engine work to frames. One frame per
session is submitted at a time (the next goes in when the previous is answered; a step
already under way may still finish work of the answered one: see `_attribute`); a frame
is answered when its work is done
(`ok`), when its deadline passes first (`late`, with what was ready), or at once when the
engine reports its session stalled on KV (`stalled_kv`: what real engines do silently;
an empty result on the beat), so frames keep going out while the truth is recorded.
Input is never dropped: an answered frame's unconsumed input stays queued in the engine
(its generation is cancelled), so the conversation's context stays complete.
No clock and no engine inside: see `runtime.ports`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.engine.session import SessionSpec
from metronome.engine.types import SessionStep, WorkStatus
from metronome.runtime.frame import Frame, FrameResult, FrameStatus
from metronome.runtime.ports import EnginePort, Scheduler, StepReport
from metronome.runtime.profile import SessionProfile


@dataclass
class _InFlight:
    frame: Frame
    deadline_at_s: float
    max_tokens: int
    input_left: int
    token_ids: list[int] = field(default_factory=list)
    start_s: float | None = None


@dataclass
class _SessionState:
    profile: SessionProfile
    waiting: deque[Frame] = field(default_factory=deque)
    in_flight: _InFlight | None = None
    backlog_tokens: int = 0  # input of already-answered frames still queued in the engine
    last_answered: FrameResult | None = None  # receives tokens that arrive after the answer
    ended_reason: str = ""


class Beat:
    def __init__(
        self,
        engine: EnginePort,
        scheduler: Scheduler,
        on_result: Callable[[FrameResult], None],
        on_step: Callable[[StepReport], None] | None = None,
        on_late_tokens: Callable[[int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.on_result = on_result
        self.on_step_report = on_step
        self.on_late_tokens = on_late_tokens  # tokens credited after their frame went out
        self.sessions: dict[int, _SessionState] = {}
        self._next_session_id = 0

    # ---- sessions ----------------------------------------------------------------------
    def open_session(self, profile: SessionProfile) -> int:
        session_id = self._next_session_id
        self._next_session_id += 1
        spec = SessionSpec(policy=profile.policy, sampling=profile.sampling,
                           max_session_tokens=profile.max_session_tokens)
        self.engine.open(session_id, spec)
        self.sessions[session_id] = _SessionState(profile)
        return session_id

    def close_session(self, session_id: int, now_s: float) -> None:
        """Answer what is still owed (`cancelled`) and free the session's blocks at once."""
        state = self.sessions.pop(session_id)
        try:
            if state.in_flight is not None:
                self._answer(state, state.in_flight, FrameStatus.CANCELLED, now_s,
                             "session closed")
            for frame in state.waiting:
                self._answer_unstarted(state, frame, FrameStatus.CANCELLED, now_s,
                                       "session closed")
        finally:  # a failing result callback must not keep the blocks
            self.engine.close(session_id)

    # ---- frames ------------------------------------------------------------------------
    def submit_frame(self, frame: Frame, now_s: float) -> None:
        state = self.sessions.get(frame.session_id)
        if state is None:
            raise KeyError(f"unknown session {frame.session_id}")
        if state.ended_reason:
            self._answer_unstarted(state, frame, FrameStatus.REJECTED, now_s, state.ended_reason)
            return
        if frame.num_input_tokens == 0:
            self._answer_unstarted(state, frame, FrameStatus.REJECTED, now_s, "empty frame")
            return
        try:
            self.engine.validate(frame.token_ids, frame.embeddings)
        except ValueError as err:  # one session's bad input is answered, never raised
            self._answer_unstarted(state, frame, FrameStatus.REJECTED, now_s, str(err))
            return
        deadline_at_s = frame.arrival_s + state.profile.deadline_s
        self.scheduler.call_at(deadline_at_s, lambda t: self._on_deadline(frame, t))
        state.waiting.append(frame)
        self._advance(frame.session_id, state)

    def _advance(self, session_id: int, state: _SessionState) -> None:
        """Put the next waiting frame in flight if none is."""
        if state.in_flight is not None or not state.waiting:
            return
        frame = state.waiting.popleft()
        max_tokens = state.profile.output_tokens_for(frame.respond)
        state.in_flight = _InFlight(
            frame, frame.arrival_s + state.profile.deadline_s, max_tokens, frame.num_input_tokens
        )
        self.engine.submit(session_id, frame.token_ids, frame.embeddings, max_tokens)

    def _on_deadline(self, frame: Frame, now_s: float) -> None:
        state = self.sessions.get(frame.session_id)
        if state is None:
            return
        # Frames queue FIFO with one deadline_s, so a waiting frame's deadline never comes
        # before the in-flight frame's: only the in-flight frame can be overtaken here.
        flight = state.in_flight
        if flight is not None and flight.frame is frame:
            self._answer(state, flight, FrameStatus.LATE, now_s, "deadline passed mid-work")
            self._advance(frame.session_id, state)

    # ---- engine steps -------------------------------------------------------------------
    def on_step(self, report: StepReport) -> None:
        for outcome in report.result.sessions:
            state = self.sessions.get(outcome.session_id)
            if state is not None:
                self._apply(outcome.session_id, state, outcome, report)
        if self.on_step_report is not None:
            self.on_step_report(report)

    def _apply(self, session_id: int, state: _SessionState, outcome: SessionStep, report) -> None:
        flight = state.in_flight
        if outcome.status is WorkStatus.STALLED_KV:
            if flight is not None:
                self._answer(state, flight, FrameStatus.STALLED_KV, report.finished_s,
                             "no free KV block")
        elif outcome.status is WorkStatus.CONTEXT_FULL:
            self._end(state, report.finished_s, "max_session_tokens reached")
            return
        else:
            self._attribute(state, flight, outcome, report)
            flight = state.in_flight
            if flight is not None and self._done(flight, outcome):
                self._answer(state, flight, FrameStatus.OK, report.finished_s)
        self._advance(session_id, state)

    def _attribute(self, state, flight: _InFlight | None, outcome: SessionStep, report) -> None:
        """Input pays the backlog of answered frames first, then the in-flight frame. Tokens
        are the in-flight frame's only once its own input is all consumed (nothing samples
        before that); otherwise they come from a step that began before the previous frame
        was answered (its deadline fell mid-step) and are that frame's late tokens."""
        paid = min(outcome.submitted_tokens, state.backlog_tokens)
        state.backlog_tokens -= paid
        own = outcome.submitted_tokens - paid
        if flight is not None and own:
            flight.start_s = report.started_s if flight.start_s is None else flight.start_s
            flight.input_left -= own
            assert flight.input_left >= 0, (flight.input_left, outcome)
        if flight is not None and flight.input_left == 0:
            flight.token_ids += outcome.new_token_ids
        elif state.last_answered is not None and outcome.new_token_ids:
            state.last_answered.late_token_ids += outcome.new_token_ids
            if self.on_late_tokens is not None:
                self.on_late_tokens(len(outcome.new_token_ids))

    @staticmethod
    def _done(flight: _InFlight, outcome: SessionStep) -> bool:
        return flight.input_left == 0 and not outcome.generating

    def _end(self, state: _SessionState, now_s: float, reason: str) -> None:
        state.ended_reason = reason
        if state.in_flight is not None:
            self._answer(state, state.in_flight, FrameStatus.CONTEXT_FULL, now_s, reason)
        while state.waiting:
            self._answer_unstarted(state, state.waiting.popleft(), FrameStatus.REJECTED, now_s,
                                   reason)

    # ---- answers ------------------------------------------------------------------------
    def _answer(self, state, flight: _InFlight, status: FrameStatus, now_s: float, reason=""):
        state.in_flight = None
        if status is not FrameStatus.OK:
            self.engine.cancel(flight.frame.session_id)
            state.backlog_tokens += flight.input_left
        result = FrameResult(
            flight.frame.session_id, flight.frame.index, status, flight.token_ids,
            flight.frame.arrival_s, flight.start_s, now_s, flight.deadline_at_s,
            flight.max_tokens > 0, reason,
        )
        state.last_answered = result
        self.on_result(result)

    def _answer_unstarted(self, state, frame: Frame, status: FrameStatus, now_s: float, reason):
        deadline_at_s = frame.arrival_s + state.profile.deadline_s
        expects = state.profile.output_tokens_for(frame.respond) > 0
        result = FrameResult(frame.session_id, frame.index, status, [], frame.arrival_s, None,
                             now_s, deadline_at_s, expects, reason)
        self.on_result(result)
