"""The beat: every frame of every session gets exactly one result, on time, with the truth.

Owns the session records (`runtime.record`) and the attribution of engine work to frames.
One frame per session is submitted at a time (the next goes in when the previous is
answered; a step already under way may still finish work of the answered one: see
`_attribute`); a frame is answered when its work is done (`ok`), when its deadline passes
first (`late`, with what was ready), or at once when the engine reports its session stalled
on KV (`stalled_kv`: what real engines do silently; an empty result on the beat), so frames
keep going out while the truth is recorded. Input is never dropped: an answered frame's
unconsumed input stays queued (its generation is cancelled), so the conversation's context
stays complete. Queued input reaches the engine through each session's feed
(`runtime.feed`): whole for a session on pace; in fair shares for one whose input runs
ahead of real time, while other sessions have frames due. A frame its owner withdraws
(`cancel_frame`: a reply the user talked over) is answered `cancelled` at once: in flight,
as at a deadline; not yet started, with its input, which never reached the engine.

Input enters here and is validated here, once (`EngineCommands.prepare_input`): bad input
is a `rejected` result, never an exception. A submitter that prepares input before it is
ready (the server encodes audio off the loop) accepts each frame first (`accept`): the
record counts it from then on, and the session's bound on queued input is checked once per
frame: at acceptance (by the submitter, `SessionRecord.fits`), or here at submission for a
frame not accepted first. A frame carries nothing of its submitter's: the server keeps what
each of its frames belongs to by frame index, beside its own session. No clock and no
engine inside: see `runtime.ports`.
"""

from __future__ import annotations

from collections.abc import Callable

from metronome.engine.engine import SessionError
from metronome.engine.session import SessionSpec
from metronome.engine.types import PreparedInput, Rebound, SessionStep, WorkStatus
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.feed import DEFAULT_FEED, LIVE_PERIODS, FeedPolicy, SessionFeed
from metronome.runtime.frame import Frame, FrameResult, FrameStatus
from metronome.runtime.ports import EngineCommands, Listeners, StepReport, Timer
from metronome.runtime.profile import SessionProfile
from metronome.runtime.record import Accepted, InFlight, SessionRecord


class Beat:
    def __init__(self, engine: EngineCommands, timer: Timer, listeners: Listeners,
                 feed_policy: FeedPolicy = DEFAULT_FEED) -> None:
        self.engine = engine
        self.timer = timer
        self.listeners = listeners
        self.feed_policy = feed_policy
        self.sessions: dict[int, SessionRecord] = {}
        self.feeds: dict[int, SessionFeed] = {}  # what of each session's input waits here

    # ---- sessions ----------------------------------------------------------------------
    def open_session(self, profile: SessionProfile, now_s: float = 0.0,
                     public_id: str | None = None,
                     on_result: Callable[[FrameResult], None] | None = None,
                     on_rebound: Callable[[Rebound], None] | None = None) -> int:
        """Open an engine session for `profile`; returns its id (the engine issued it)."""
        session_id = self.engine.new_session_id()
        spec = SessionSpec(policy=profile.policy, sampling=profile.sampling,
                           max_session_tokens=profile.max_session_tokens)
        self.engine.open_session(spec, session_id)
        self.sessions[session_id] = SessionRecord(session_id, profile, now_s, public_id,
                                                  on_result, on_rebound)
        self.feeds[session_id] = SessionFeed()
        return session_id

    def adopt_session(self, profile: SessionProfile, session_id: int, now_s: float,
                      public_id: str | None, on_result: Callable[[FrameResult], None] | None,
                      on_rebound: Callable[[Rebound], None] | None, frames_submitted: int,
                      bound: ResidencyPolicy | None) -> None:
        """A session the engine holds already (restored from a snapshot: `engine.snapshot`),
        with no frame outstanding: its frames are numbered on from `frames_submitted`."""
        assert session_id not in self.sessions, session_id
        record = SessionRecord(session_id, profile, now_s, public_id, on_result, on_rebound)
        record.frames_submitted = record.frames_answered = frames_submitted
        record.bound = bound
        self.sessions[session_id] = record
        self.feeds[session_id] = SessionFeed()

    def close_session(self, session_id: int, now_s: float) -> None:
        """Answer what is still owed (`cancelled`) and free the session's blocks at once."""
        record = self._record(session_id)
        del self.sessions[session_id]
        try:
            if record.in_flight is not None:
                self._answer(record, record.in_flight, FrameStatus.CANCELLED, now_s,
                             "session closed")
            for frame, _ in record.waiting:
                self._answer_unstarted(record, frame, FrameStatus.CANCELLED, now_s,
                                       "session closed")
        finally:  # a failing result callback must not keep the blocks
            del self.feeds[session_id]  # its held input goes with it
            self.engine.close(session_id)
        self._feed_all(now_s)  # a frame it had in flight may have held others back

    def _record(self, session_id: int) -> SessionRecord:
        record = self.sessions.get(session_id)
        if record is None:
            raise SessionError(f"unknown session {session_id} (never opened, or closed)")
        return record

    # ---- frames ------------------------------------------------------------------------
    def accept(self, session_id: int, num_tokens: int) -> Accepted:
        """A frame its submitter accepted and will submit once its input is prepared (the
        server: audio on the encoder thread): it counts in the record from now on. The
        submitter has checked `record.fits(num_tokens)`; hand the result to `submit_frame`,
        or to `withdraw` if no frame comes of it."""
        record = self._record(session_id)
        accepted = Accepted(session_id, num_tokens)
        record.accepted.append(accepted)
        return accepted

    def withdraw(self, accepted: Accepted) -> None:
        """An accepted frame that will not be submitted (its input came out empty)."""
        self._take(self._record(accepted.session_id), accepted)

    @staticmethod
    def _take(record: SessionRecord, accepted: Accepted) -> None:
        assert any(a is accepted for a in record.accepted), "accepted frame taken twice"
        record.accepted = [a for a in record.accepted if a is not accepted]

    def submit_frame(self, frame: Frame, now_s: float, accepted: Accepted | None = None) -> None:
        """Queue `frame` (answered at once if refused). `accepted`: the frame was accepted
        earlier (`accept`) and its input checked against the session's bound then."""
        record = self._record(frame.session_id)
        if accepted is not None:
            assert accepted.session_id == frame.session_id, (accepted, frame.session_id)
            self._take(record, accepted)
        record.frames_submitted += 1
        if record.ended_reason:
            self._answer_unstarted(record, frame, FrameStatus.REJECTED, now_s,
                                   record.ended_reason)
            return
        try:
            prepared = self.engine.prepare_input(frame.token_ids, frame.embeddings)
        except SessionError as err:  # one session's bad input is answered, never raised
            self._answer_unstarted(record, frame, FrameStatus.REJECTED, now_s, str(err))
            return
        if prepared.num_tokens == 0:
            self._answer_unstarted(record, frame, FrameStatus.REJECTED, now_s, "empty frame")
            return
        if accepted is None and not record.fits(prepared.num_tokens):
            # refused before it is accepted: nothing accepted is ever dropped
            self._answer_unstarted(record, frame, FrameStatus.REJECTED, now_s,
                                   _queue_full(record, prepared.num_tokens))
            return
        deadline_at_s = frame.arrival_s + record.profile.deadline_s
        self.timer.call_at(deadline_at_s, lambda t: self._on_deadline(frame, t))
        record.waiting.append((frame, prepared))
        self._advance(record)
        self._feed_all(now_s)

    def _advance(self, record: SessionRecord) -> None:
        """Put the next waiting frame in flight if none is."""
        if record.in_flight is not None or not record.waiting:
            return
        frame, prepared = record.waiting.popleft()
        max_tokens = record.profile.output_tokens_for(frame.respond)
        record.in_flight = InFlight(frame, frame.arrival_s + record.profile.deadline_s,
                                    max_tokens, prepared.num_tokens,
                                    queued_ahead_tokens=record.backlog_tokens)
        self.feeds[record.session_id].hold(prepared.data, max_tokens)

    # ---- feeding the engine (runtime.feed) ----------------------------------------------
    def _ahead(self, record: SessionRecord) -> bool:
        """Its input runs ahead of real time: a frame queued behind its own, or more than
        one step's chunk of its own input queued (`admission.pacing`'s two rules). A
        backlog that KV stalls left is the server's doing, not the session's: it goes in
        whole, as before (fed in shares it would fit the last free blocks and turn
        `stalled_kv` frames into slow, late ones)."""
        return bool(record.waiting) or (
            record.submitted_queued_tokens > self.feed_policy.ahead_tokens
            and record.last_status is not FrameStatus.STALLED_KV)

    @staticmethod
    def _live(record: SessionRecord, now_s: float) -> bool:
        """It has a frame under way, or had one arrive recently enough to send the next."""
        last = record.last_answered
        return bool(record.in_flight or record.waiting or record.accepted) or (
            last is not None
            and now_s - last.arrival_s < LIVE_PERIODS * record.profile.frame_period_s)

    def _feed_all(self, now_s: float) -> None:
        """Hand each session the input the feed policy lets the engine hold now."""
        ahead = {sid: self._ahead(r) for sid, r in self.sessions.items()}
        contended = any(r.in_flight is not None and not ahead[sid]
                        for sid, r in self.sessions.items())
        live = {sid: self._live(r, now_s) for sid, r in self.sessions.items()}
        num_live = sum(live.values())
        for sid in self.sessions:
            feed = self.feeds[sid]
            if not feed.held:
                continue
            alone = num_live - live[sid] == 0  # no other session live, ahead or on pace
            limit = self.feed_policy.engine_tokens(ahead[sid], contended, alone)
            for piece in feed.take(limit):
                self.engine.submit_prepared(sid, PreparedInput(piece.data),
                                            piece.max_new_tokens)

    def cancel_frame(self, session_id: int, index: int, now_s: float, reason: str) -> bool:
        """Answer frame `index` `cancelled` now; False if it was already answered."""
        record = self._record(session_id)
        flight = record.in_flight
        if flight is not None and flight.frame.index == index:
            self._answer(record, flight, FrameStatus.CANCELLED, now_s, reason)
            self._advance(record)
            self._feed_all(now_s)
            return True
        for position, (frame, _) in enumerate(record.waiting):
            if frame.index == index:
                del record.waiting[position]
                self._answer_unstarted(record, frame, FrameStatus.CANCELLED, now_s, reason)
                return True
        return False

    def _on_deadline(self, frame: Frame, now_s: float) -> None:
        record = self.sessions.get(frame.session_id)
        if record is None:
            return
        # Frames queue FIFO with one deadline_s, so a waiting frame's deadline never comes
        # before the in-flight frame's: only the in-flight frame can be overtaken here.
        flight = record.in_flight
        if flight is not None and flight.frame is frame:
            self._answer(record, flight, FrameStatus.LATE, now_s, "deadline passed mid-work")
            self._advance(record)
            self._feed_all(now_s)

    # ---- engine steps -------------------------------------------------------------------
    def on_step(self, report: StepReport) -> None:
        for rebound in report.result.rebounds:
            self._rebound(rebound)
        for outcome in report.result.sessions:
            record = self.sessions.get(outcome.session_id)
            if record is not None:
                self._apply(record, outcome, report)
        self._feed_all(report.finished_s)
        self.listeners.on_step(report)

    def _rebound(self, rebound: Rebound) -> None:
        """The engine bound a session under KV pressure: its record and its owner learn of
        it (the server tells the client); its frames go on as before."""
        record = self.sessions.get(rebound.session_id)
        if record is None:
            return
        record.bound = rebound.policy
        self.listeners.on_rebound(rebound)
        if record.on_rebound is not None:
            record.on_rebound(rebound)

    def _apply(self, record: SessionRecord, outcome: SessionStep, report: StepReport) -> None:
        flight = record.in_flight
        if outcome.status is WorkStatus.STALLED_KV:
            if flight is not None:
                self._answer(record, flight, FrameStatus.STALLED_KV, report.finished_s,
                             "no free KV block")
        elif outcome.status is WorkStatus.CONTEXT_FULL:
            self._end(record, report.finished_s, "max_session_tokens reached")
            return
        else:
            self.feeds[record.session_id].consumed(outcome.submitted_tokens)
            self._attribute(record, flight, outcome, report)
            flight = record.in_flight
            if flight is not None and self._done(flight, outcome):
                self._answer(record, flight, FrameStatus.OK, report.finished_s)
        self._advance(record)

    def _attribute(self, record: SessionRecord, flight: InFlight | None, outcome: SessionStep,
                   report: StepReport) -> None:
        """Input pays the backlog of answered frames first, then the in-flight frame. Tokens
        are the in-flight frame's only once its own input is all consumed (nothing samples
        before that); otherwise they come from a step that began before the previous frame
        was answered (its deadline fell mid-step) and are that frame's late tokens."""
        paid = min(outcome.submitted_tokens, record.backlog_tokens)
        record.backlog_tokens -= paid
        own = outcome.submitted_tokens - paid
        if flight is not None and own:
            flight.start_s = report.started_s if flight.start_s is None else flight.start_s
            flight.input_left -= own
            assert flight.input_left >= 0, (flight.input_left, outcome)
        if flight is not None and flight.input_left == 0:
            flight.token_ids += outcome.new_token_ids
        elif record.last_answered is not None and outcome.new_token_ids:
            record.last_answered.late_token_ids += outcome.new_token_ids
            self.listeners.on_late_tokens(len(outcome.new_token_ids))

    @staticmethod
    def _done(flight: InFlight, outcome: SessionStep) -> bool:
        return flight.input_left == 0 and not outcome.generating

    def _end(self, record: SessionRecord, now_s: float, reason: str) -> None:
        record.ended_reason = reason
        self.feeds[record.session_id].clear()  # the engine ended it: it takes no more input
        if record.in_flight is not None:
            self._answer(record, record.in_flight, FrameStatus.CONTEXT_FULL, now_s, reason)
        while record.waiting:
            frame, _ = record.waiting.popleft()
            self._answer_unstarted(record, frame, FrameStatus.REJECTED, now_s, reason)

    # ---- answers ------------------------------------------------------------------------
    def _answer(self, record: SessionRecord, flight: InFlight, status: FrameStatus,
                now_s: float, reason: str = "") -> None:
        record.in_flight = None
        if status is not FrameStatus.OK:
            self.engine.cancel_generation(record.session_id)
            self.feeds[record.session_id].cancel_generation()
            record.backlog_tokens += flight.input_left
        frame = flight.frame
        result = FrameResult(
            frame.session_id, frame.index, status, flight.token_ids, frame.arrival_s,
            flight.start_s, now_s, flight.deadline_at_s, flight.max_tokens > 0, reason,
            input_tokens=frame.num_input_tokens, queued_ahead_tokens=flight.queued_ahead_tokens,
        )
        record.last_answered = result
        self._deliver(record, result)

    def _answer_unstarted(self, record: SessionRecord, frame: Frame, status: FrameStatus,
                          now_s: float, reason: str) -> None:
        deadline_at_s = frame.arrival_s + record.profile.deadline_s
        expects = record.profile.output_tokens_for(frame.respond) > 0
        self._deliver(record, FrameResult(frame.session_id, frame.index, status, [],
                                          frame.arrival_s, None, now_s, deadline_at_s,
                                          expects, reason,
                                          input_tokens=frame.num_input_tokens,
                                          queued_ahead_tokens=record.submitted_queued_tokens))

    def _deliver(self, record: SessionRecord, result: FrameResult) -> None:
        record.frames_answered += 1
        assert record.frames_answered <= record.frames_submitted, (
            record.frames_answered, record.frames_submitted)
        record.last_status = result.status
        self.listeners.on_result(result)
        if record.on_result is not None:
            record.on_result(result)


def _queue_full(record: SessionRecord, num_tokens: int) -> str:
    """Why a frame of `num_tokens` does not fit in the session's queued input."""
    return (f"input queue full: {record.queued_input_tokens} tokens of this session's input "
            f"are not yet processed and this frame adds {num_tokens}; the limit is "
            f"{record.profile.max_queued_input_tokens}")
