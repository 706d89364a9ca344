"""The beat: the runtime's scheduler. Every frame of every session gets exactly one result,
on time, with the truth.

It owns the sessions' `Stream`s (`metronome.stream`: the one record of a session, input and
frames) and three decisions, all on the loop's clock:

* **Deadlines.** One frame per session is in flight at a time; the next goes in when the
  previous is answered. A frame is answered when its work is done (`ok`), when its deadline
  passes first (`late`, with what was ready), or at once when the engine reports its session
  stalled on KV (`stalled_kv`: what real engines do silently). A paced frame (a turn's
  reply: an output stream) is due at its first output and is never cut: it ends at its
  budget or the model's stop, and its listener's pace says whether it kept ahead (its owner
  counts the gaps, `serve.realtime.pacing`). Input is never dropped: an
  answered frame's unprocessed input stays in the stream and still goes to the engine (its
  generation cancelled), so the conversation's context stays whole. The one frame whose
  input goes is one its owner withdraws before it went in flight (`cancel`: a reply the
  user spoke over); that input never reached the engine. A held session (`hold`: its
  client is away) has every frame answered `cancelled` and nothing fed until `release`.
* **The feed.** The engine plans a step from what it was fed (round-robin, a chunk per
  session) and knows nothing of deadlines, so the beat decides how much of each stream's
  input it may read (`FeedPolicy`): a session on pace has its frame's input fed whole; one
  ahead of real time (a frame queued behind its own, or more than one step's chunk queued:
  audio sent fast, a flood of text) gets one frame's share per step while others have frames
  due, a full chunk while nobody waits, and the engine's long-prefill chunk when it is alone.
  The budget of new tokens goes with the feed that reaches the end of the frame's input, so
  the engine samples only after all of it.
* **Context.** Input that asks for no answer (a turn session's text items and
  instructions) joins the stream with no frame (`append_context`): no deadline, no result,
  limited only by the session's bound on queued input, so a restored history is taken in a
  burst; the feed gives it to the engine as any backlog. A frame submitted while context
  is queued ahead of it is due `deadline_s` after that context is in, and its own input is
  fed only then (withdrawn before, it leaves no prompt in the KV).
* **Attribution.** A step's consumed input pays the answered frames' backlog first, then the
  frame in flight; its tokens are the frame's once its input is all consumed (nothing samples
  before that), else they come from a step that began before the previous frame was answered
  (its deadline fell mid-step) and are that frame's late tokens.

Input is validated once, where it enters (`submit`: `EnginePort.check_input`); bad input is a
`rejected` result, never an exception. A submitter that prepares input off the loop (the
server encodes audio on a thread) accepts each frame first (`accept`): the stream counts it
from then on, and the session's bound on queued input is checked once per frame (at
acceptance by the submitter, `Stream.fits`, or here at submission). Engine commands go
through `run_on_engine` (the driver's: queued for the engine thread, or run at once) and
questions through `ask_engine` (their `Answer` comes back here); no clock and no engine
thread here.

The engine's optional features are beat commands too (`set_policy`, `repin`,
`rewind_reply`, `snapshot`, `restore`), so each runs in order with the session's input;
`serves(feature)` says whether the engine has one (it declares them: `EnginePort.features`).
What the beat tells a stream's owner (`StreamOwner`: results, tokens, rebounds) it tells
guarded, in one place (`_tell_owner`): one owner that fails never stops the beat.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from metronome.engine.engine import EngineConfig, SessionError, unsupported
from metronome.engine.snapshot import SessionSnapshot
from metronome.engine.types import EngineFeature, Rebound, StepOutput, WorkStatus
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.ports import Answer, AskEngine, EnginePort, Listeners, RunOnEngine, Timer
from metronome.stream import Frame, FrameStatus, Stream, StreamOwner

log = logging.getLogger(__name__)

REPLY_KIND = "response"  # a frame that asks for a reply; its input is the reply's prompt
ONE_FRAME_TOKENS = 16  # a 1 s audio frame is 12-25 tokens; 16 keeps it on the paged path
LIVE_PERIODS = 2.0  # a session whose last frame arrived this many periods ago may send more


@dataclass(frozen=True)
class Snapshotted:
    """A session's snapshot (`Beat.snapshot`) and the engine-thread time it took (the next
    step waited as long)."""

    snapshot: SessionSnapshot
    engine_s: float


@dataclass(frozen=True)
class FeedPolicy:
    """How much of a session's input the engine may hold (fed, not yet consumed).

    On pace (at most one frame of its own, `ahead_tokens` or less queued): all of the frame.
    Ahead of real time: `fair_tokens` while any on-pace session has a frame in flight
    (contended: its prefill takes one frame's share of a step, as a streamer's frame does,
    and the step stays short); `free_engine_tokens` (one full chunk) while none does (two
    chunks measured slower: the due frames waited behind both). While an on-pace session is
    live, those pieces come out of one chunk for all the sessions ahead together
    (`free_engine_tokens`, taken in turns): 32 sessions with text queued took a chunk each
    between a neighbour's frames, a 1,232-token step of 1.6 s, and a fair share each while
    its frame was in flight, 513 tokens, and the neighbour's frames waited behind both.
    `alone_engine_tokens` (the engine's long-prefill chunk) when no other session is live
    (none has a frame under way, or had one arrive within `LIVE_PERIODS` of its frame
    periods, or opened within them and sent none yet). Other ahead sessions
    count as live: streamers fallen behind are ahead, and under overload they would all get
    large pieces (40 streaming sessions: goodput 0.957 and 0.969 with that vs 1.000 without).
    A limited piece is fed once the engine has consumed the last one (the engine takes one
    chunk per step from a session: pieces fed while one is there would run as fragments).
    Ahead is the queue half of `admission.pacing`'s self-paced judgement, so the sessions
    admission leaves out of its signal are among those the feed holds back; admission also
    asks that the input arrived ahead of real time by the clock, so a streamer fallen behind
    is held back here but stays in its signal.
    """

    ahead_tokens: int = EngineConfig.max_chunk_tokens
    fair_tokens: int = ONE_FRAME_TOKENS
    free_engine_tokens: int = EngineConfig.max_chunk_tokens
    alone_engine_tokens: int = EngineConfig.max_prefill_chunk_tokens
    # False: every session's input goes in whole, as before the feed (before/after runs)
    metered: bool = True

    def __post_init__(self) -> None:
        for name in ("ahead_tokens", "fair_tokens", "free_engine_tokens",
                     "alone_engine_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def for_engine(cls, config: EngineConfig) -> FeedPolicy:
        """Ahead means more than one of this engine's step chunks queued."""
        chunk = config.max_chunk_tokens
        return cls(ahead_tokens=chunk, free_engine_tokens=chunk,
                   alone_engine_tokens=max(chunk, config.max_prefill_chunk_tokens))

    def engine_tokens(self, ahead: bool, contended: bool, alone: bool = False) -> int | None:
        """How much of a session's input the engine may hold now (None: all of it)."""
        if not (ahead and self.metered):
            return None
        if contended:
            return self.fair_tokens
        return self.alone_engine_tokens if alone else self.free_engine_tokens


class Beat:
    def __init__(self, engine: EnginePort, run_on_engine: RunOnEngine, ask_engine: AskEngine,
                 timer: Timer, listeners: Listeners,
                 feed_policy: FeedPolicy | None = None) -> None:
        self.engine = engine
        self.run_on_engine = run_on_engine
        self.ask_engine = ask_engine
        self.timer = timer
        self.listeners = listeners
        self.feed_policy = feed_policy or FeedPolicy.for_engine(engine.config)
        self.streams: dict[str, Stream] = {}  # the sessions it serves, by id
        self._turn = 0  # whose turn it is first at the shared free chunk (`_feed_all`)

    # ---- sessions ----------------------------------------------------------------------
    def add(self, stream: Stream) -> None:
        """Serve a new session: the engine opens it (on its thread)."""
        self._register(stream)
        self.run_on_engine(lambda: self.engine.open_session(stream))

    def adopt(self, stream: Stream) -> None:
        """Serve a session the engine holds already (restored from a snapshot:
        `engine.snapshot`), with no frame outstanding; its frames are numbered on from
        `stream.frames_submitted`."""
        assert not stream.frames, stream
        stream.frames_answered = stream.frames_submitted
        self._register(stream)

    def _register(self, stream: Stream) -> None:
        if stream.id in self.streams:
            raise SessionError(f"session {stream.id} is already open")
        self.streams[stream.id] = stream

    def close(self, stream: Stream, now_s: float) -> None:
        """Answer what is still owed (`cancelled`) and free the session's blocks at once."""
        assert self.streams.get(stream.id) is stream, stream
        del self.streams[stream.id]
        try:
            if stream.in_flight is not None:
                self._answer(stream, stream.in_flight, FrameStatus.CANCELLED, now_s,
                             "session closed")
            for frame in self._waiting(stream):
                self._answer_unstarted(stream, frame, FrameStatus.CANCELLED, now_s,
                                       "session closed")
        finally:  # a failing result callback must not keep the blocks
            self.run_on_engine(lambda: self.engine.close(stream.id))
        self._feed_all(now_s)  # a frame it had in flight may have held others back

    # ---- frames ------------------------------------------------------------------------
    def accept(self, stream: Stream, frame: Frame) -> None:
        """A frame its submitter accepted and will `submit` once its input is prepared (the
        server: audio on the encoder thread), counted at `frame.input_tokens` from now on.
        The submitter has checked `stream.fits`; `withdraw` it if no input comes."""
        assert self.streams.get(stream.id) is stream and frame.session_id == stream.id
        self._schedule(stream, frame)
        stream.frames.append(frame)

    def withdraw(self, frame: Frame) -> None:
        """An accepted frame that will not be submitted (its input came out empty)."""
        stream = self.streams[frame.session_id]
        assert frame.end_offset is None, "only a frame still being prepared is withdrawn"
        stream.frames.remove(frame)

    def submit(self, frame: Frame, now_s: float, token_ids: list[int] | torch.Tensor | None = None,
               embeddings: torch.Tensor | None = None) -> None:
        """The frame's input (answered at once if refused). A frame not accepted earlier is
        checked against the session's bound on queued input here."""
        stream = self.streams.get(frame.session_id)
        if stream is None:
            raise SessionError(f"unknown session {frame.session_id} (never opened, or closed)")
        accepted = any(f is frame for f in stream.frames)
        if not accepted:
            self._schedule(stream, frame)
        frame.index = stream.frames_submitted
        stream.frames_submitted += 1
        frame.input_tokens = _count(token_ids, embeddings)  # the real count, valid or not
        refusal = stream.ended_reason
        data = None
        if not refusal:
            try:
                data = self.engine.check_input(token_ids, embeddings)
            except SessionError as err:  # one session's bad input is answered, never raised
                refusal = str(err)
        if data is None or len(data) == 0:
            refusal = refusal or "empty frame"
        elif not refusal and not accepted and not stream.fits(int(data.shape[0])):
            # refused before it is accepted: nothing accepted is ever dropped
            refusal = _queue_full(stream, int(data.shape[0]))
        if refusal or data is None:
            if accepted:
                stream.frames.remove(frame)
            self._answer_unstarted(stream, frame, FrameStatus.REJECTED, now_s, refusal)
            return
        frame.start_offset, frame.end_offset = stream.append(data)
        frame.submitted_s = now_s
        if not accepted:
            stream.frames.append(frame)
        if stream.context_pending:  # due once the context ahead of it is in (`_context_in`)
            frame.behind_context_until = stream.context_until
        else:  # never due before a frame ahead of it (one that `_context_in` moved)
            frame.deadline_at_s = max([frame.deadline_at_s] + [
                f.deadline_at_s for f in stream.frames
                if f is not frame and f.end_offset is not None and f.status is None])
            self._arm(frame)
        if stream.held_reason and frame.kind == REPLY_KIND:  # (held: none in flight)
            self.cancel(frame, now_s, stream.held_reason)  # a reply asked for while held
        self._advance(stream)
        if stream.held_reason:
            self._answer_held(stream, now_s)
        self._feed_all(now_s)
        if frame.reason and frame.status is None:  # withdrawn while it was being prepared
            self.cancel(frame, now_s, frame.reason)

    def _arm(self, frame: Frame) -> None:
        """Answer `frame` at its deadline if it is in flight then (a deadline moved later by
        `_context_in` makes the earlier call stale); a paced frame is never cut: no timer."""
        if frame.paced:
            return
        at_s = frame.deadline_at_s
        self.timer.call_at(at_s, lambda t: self._on_deadline(frame, t, at_s))

    # ---- context -------------------------------------------------------------------------
    def accept_context(self, stream: Stream, max_tokens: int) -> None:
        """Context its submitter accepted (the server: a text item, before it is tokenized)
        and will `append_context` once prepared, counted at `max_tokens` (the most it can
        make; the submitter checked `stream.fits`) until then."""
        assert self.streams.get(stream.id) is stream and max_tokens >= 0, stream
        stream.preparing_context_tokens += max_tokens

    def append_context(self, stream: Stream, max_tokens: int, token_ids: torch.Tensor | None,
                       now_s: float) -> str:
        """Context accepted at `max_tokens` (`accept_context`) joins the end of the stream
        with no frame: no deadline of its own and no answer; the feed gives it to the engine
        as it gives a backlog (in large chunks while the engine is free, a share beside live
        sessions), and a frame submitted while it is queued is due `deadline_s` after it is
        in (`_context_in`): the burst is its client's own load, not a late server. None ids:
        it will not come (withdrawn). Why it was refused ('' if it was not): the session
        ended, or the input is not the engine's. The reservation is released only once the
        context is in the stream, so the queued input read from another thread (a probe, a
        test) never dips to none between the two."""
        refusal = ""
        if token_ids is not None and len(token_ids) > 0:
            refusal = self._append_context(stream, max_tokens, token_ids)
        stream.preparing_context_tokens -= max_tokens
        assert stream.preparing_context_tokens >= 0, stream
        if not refusal:
            self._feed_all(now_s)
        return refusal

    def _append_context(self, stream: Stream, max_tokens: int, token_ids: torch.Tensor) -> str:
        if stream.ended_reason:
            return stream.ended_reason
        try:
            data = self.engine.check_input(token_ids, None)
        except SessionError as err:  # one session's bad input is refused, never raised
            return str(err)
        assert data is not None and len(data) <= max_tokens, (len(token_ids), max_tokens)
        _, stream.context_until = stream.append(data)
        return ""

    def _context_in(self, stream: Stream, now_s: float) -> None:
        """Frames submitted behind context that is now processed: each is due `deadline_s`
        from now, or at its own deadline if that is later."""
        for frame in stream.frames:
            until = frame.behind_context_until
            if until is not None and stream.consumed_tokens >= until:
                frame.behind_context_until = None
                frame.deadline_at_s = max(frame.deadline_at_s, now_s + stream.profile.deadline_s)
                self._arm(frame)

    def _schedule(self, stream: Stream, frame: Frame) -> None:
        profile = stream.profile
        frame.deadline_at_s = frame.arrival_s + profile.deadline_s
        frame.max_new_tokens = profile.output_tokens_for(frame.respond)
        if frame.respond and frame.output_budget_tokens is not None:
            frame.max_new_tokens = frame.output_budget_tokens  # its submitter's (a reply's)

    def cancel(self, frame: Frame, now_s: float, reason: str) -> bool:
        """Answer `frame` `cancelled` now: in flight, as at a deadline; waiting (or in flight
        with none of its input fed yet: behind context), with its input, which never reached
        the engine (a reply's prompt left in the KV would open a turn nobody answers); still
        being prepared, once it is submitted. False if it was already answered."""
        stream = self.streams.get(frame.session_id)
        if stream is None or frame.status is not None:
            return False
        if frame is stream.in_flight and not self._unfed(stream, frame):
            self._answer(stream, frame, FrameStatus.CANCELLED, now_s, reason)
            self._advance(stream)
            self._feed_all(now_s)
        elif frame.end_offset is not None:  # waiting, or in flight behind context still fed
            in_flight = frame is stream.in_flight
            if in_flight:
                stream.in_flight = None
            stream.drop(frame)
            stream.frames.remove(frame)
            self._answer_unstarted(stream, frame, FrameStatus.CANCELLED, now_s, reason)
            if in_flight:
                self._advance(stream)
                self._feed_all(now_s)
        else:
            frame.reason = reason  # answered as soon as it is submitted
        return True

    def hold(self, stream: Stream, now_s: float, reason: str) -> None:
        """Its client is away (a lease): every frame it owes is answered `cancelled` now, as
        at a deadline (their unprocessed input stays in the stream: the user's words are
        kept), but a reply that has not begun (a `REPLY_KIND` frame waiting: its input is the
        reply's prompt) is withdrawn, as a reply the user spoke over; frames submitted while
        held likewise. None of its input is fed until `release`: a dropped client keeps no
        engine busy (what the engine holds already, one piece at most, is processed)."""
        assert self.streams.get(stream.id) is stream, stream
        stream.held_reason = reason
        for frame in [stream.in_flight, *self._waiting(stream)]:
            if frame is not None and frame.kind == REPLY_KIND and self._unfed(stream, frame):
                self.cancel(frame, now_s, reason)  # a reply not begun: withdrawn
        self._answer_held(stream, now_s)

    def release(self, stream: Stream, now_s: float) -> None:
        """Its client is back: its input is fed again (the held frames' input first)."""
        stream.held_reason = ""
        self._feed_all(now_s)

    def _answer_held(self, stream: Stream, now_s: float) -> None:
        self._advance(stream)
        while stream.in_flight is not None:
            self._answer(stream, stream.in_flight, FrameStatus.CANCELLED, now_s,
                         stream.held_reason)
            self._advance(stream)

    @staticmethod
    def _unfed(stream: Stream, frame: Frame) -> bool:
        """None of its input has gone to the engine (a frame waiting, or one in flight behind
        context the engine still reads): withdrawn, it leaves with its input."""
        return frame.end_offset is not None and stream.fed_tokens <= frame.span[0]

    @staticmethod
    def _waiting(stream: Stream) -> list[Frame]:
        """Frames whose input is in the stream and that are not in flight, in stream order."""
        return sorted((f for f in stream.frames
                       if f.end_offset is not None and f is not stream.in_flight),
                      key=lambda f: f.span[0])

    def _advance(self, stream: Stream) -> None:
        """Put the next waiting frame in flight if none is."""
        if stream.in_flight is not None or stream.ended_reason:
            return
        waiting = self._waiting(stream)
        if waiting:
            frame = stream.in_flight = waiting[0]
            frame.queued_ahead_tokens = stream.backlog_tokens

    def _on_deadline(self, frame: Frame, now_s: float, at_s: float) -> None:
        stream = self.streams.get(frame.session_id)
        # Frames go in flight in order with one deadline_s (a context's frames moved
        # together, `_context_in`), so a waiting frame's deadline never comes before the
        # in-flight frame's: only that one can be overtaken here.
        if stream is not None and stream.in_flight is frame and at_s == frame.deadline_at_s:
            prepared_late = frame.submitted_s is not None and (
                frame.submitted_s >= frame.deadline_at_s)
            self._answer(stream, frame, FrameStatus.LATE, now_s,
                         "deadline passed while its input was prepared (the encoder behind)"
                         if prepared_late else "deadline passed mid-work")
            self._advance(stream)
            self._feed_all(now_s)

    # ---- the feed ----------------------------------------------------------------------
    def _ahead(self, stream: Stream) -> bool:
        """Its input runs ahead of real time: a frame queued behind its own, or more than one
        step's chunk of its own input queued (the queue halves of `admission.pacing`'s two
        rules; its pace rule also reads the input's arrival against the clock). A backlog that
        KV stalls left is the server's doing, not the session's: it goes in whole (fed in
        shares it would fit the last free blocks and turn `stalled_kv` frames into slow,
        late ones)."""
        return bool(self._waiting(stream)) or (
            stream.submitted_queued_tokens > self.feed_policy.ahead_tokens
            and stream.last_status is not FrameStatus.STALLED_KV)

    @staticmethod
    def _live(stream: Stream, now_s: float) -> bool:
        """It has a frame under way, or had one arrive (or, none yet, opened) recently enough
        to send the next: a session that just opened is about to send its first frame (the
        lease attack run alone: 32 sessions ahead took a chunk each before the neighbour's
        first frame, and its first two frames were late behind them)."""
        last = stream.last_answered
        since_s = stream.opened_at_s if last is None else last.arrival_s
        return bool(stream.frames) or (
            now_s - since_s < LIVE_PERIODS * stream.profile.frame_period_s)

    def _feed_all(self, now_s: float) -> None:
        """Feed each session what the feed policy lets the engine hold now."""
        streams = [s for s in self.streams.values()
                   if not (s.ended_reason or s.held_reason)]
        ahead = {s.id: self._ahead(s) for s in streams}
        contended = any(s.in_flight is not None and not ahead[s.id] for s in streams)
        live = {s.id: self._live(s, now_s) for s in streams}
        num_live = sum(live.values())
        shared = self._shared_free_tokens(streams, ahead, live, contended)
        if shared is not None:  # the sessions ahead take turns at the one free chunk
            self._turn += 1
            turn = self._turn % len(streams)
            streams = streams[turn:] + streams[:turn]
        for stream in streams:
            if stream.fed_tokens >= stream.feedable_until:
                continue
            alone = num_live - live[stream.id] == 0  # no other session live, ahead or on pace
            limit = self.feed_policy.engine_tokens(ahead[stream.id], contended, alone)
            if shared is None or not ahead[stream.id] or limit is None:
                self._feed(stream, limit)
            elif shared > 0:
                shared -= self._feed(stream, min(limit, shared))

    def _shared_free_tokens(self, streams: list[Stream], ahead: dict[str, bool],
                            live: dict[str, bool], contended: bool) -> int | None:
        """While an on-pace session is live, what is left of the one chunk
        (`free_engine_tokens`) that the sessions ahead of real time share, less what the
        engine holds of theirs; None when no on-pace session is live to wait behind them."""
        policy = self.feed_policy
        if not policy.metered or not any(live[s.id] and not ahead[s.id] for s in streams):
            return None
        held = sum(s.fed_tokens - s.consumed_tokens for s in streams if ahead[s.id])
        return policy.free_engine_tokens - held

    def _feed(self, stream: Stream, limit_tokens: int | None) -> int:
        """Feed the engine up to `limit_tokens` more of the stream (None: all it may read),
        once it has consumed what it holds; the frame's budget with its input's end. How
        many tokens it fed."""
        start, end = stream.fed_tokens, stream.feedable_until
        if limit_tokens is not None:
            if start > stream.consumed_tokens:
                return 0  # the engine still holds a piece
            end = min(end, start + limit_tokens, stream.kind_run_end(start))
        budget = 0
        flight = stream.in_flight
        if flight is not None and not flight.budget_fed and end == flight.end_offset:
            budget, flight.budget_fed = flight.max_new_tokens, True
        stream.fed_tokens = end
        self.run_on_engine(lambda: self.engine.feed(stream.id, end - start, budget))
        return end - start

    # ---- the engine's optional features (EnginePort.features) -----------------------------
    def serves(self, feature: EngineFeature) -> bool:
        return feature in self.engine.features

    def _require(self, feature: EngineFeature) -> None:
        if not self.serves(feature):  # callers ask `serves` first: this is a bug
            raise unsupported(type(self.engine).__name__, feature)

    def set_policy(self, stream: Stream, policy: ResidencyPolicy) -> None:
        """The session is served under `policy` from now on (its spec's, checked against the
        engine's limits by its owner): in the engine's order, before any input fed later."""
        self._require(EngineFeature.SESSION_POLICY)
        stream.spec = replace(stream.spec, policy=policy)
        stream.bound = None
        self.run_on_engine(lambda: self.engine.set_policy(stream.id, policy))

    def repin(self, stream: Stream, token_ids: list[int]) -> Answer[bool]:
        """`token_ids` become the session's pinned prefix once the window has left the old one
        (`EnginePort.repin`; a `pinned` rebound says when): True if done at once."""
        self._require(EngineFeature.REPIN)
        return self.ask_engine(lambda: self.engine.repin(stream.id, token_ids))

    def rewind_reply(self, stream: Stream, keep_tokens: int) -> Answer[int]:
        """All but `keep_tokens` of the session's latest reply leave its KV (an exception if
        the session read input since: its rewind horizon passed); the tokens forgotten."""
        self._require(EngineFeature.REWIND)
        return self.ask_engine(lambda: self.engine.rewind_reply(stream.id, keep_tokens))

    def snapshot(self, stream: Stream) -> Answer[Snapshotted]:
        """The session's whole engine state, as of every command queued before this one."""
        self._require(EngineFeature.SNAPSHOT)

        def take() -> Snapshotted:
            start = time.perf_counter()
            snapshot = self.engine.snapshot_session(stream.id)  # a copy: serialized elsewhere
            return Snapshotted(snapshot, time.perf_counter() - start)

        return self.ask_engine(take)

    def restore(self, snapshot: SessionSnapshot, stream: Stream) -> Answer[bool]:
        """Open `snapshot` in the engine as `stream` (False: its pool cannot hold it); the
        beat serves it once its owner `adopt`s it."""
        self._require(EngineFeature.SNAPSHOT)
        return self.ask_engine(lambda: self.engine.restore_session(snapshot, stream))

    # ---- engine steps ------------------------------------------------------------------
    def on_step(self, out: StepOutput) -> None:
        for rebound in out.rebounds:
            self._rebound(rebound)
        for sid, status in out.status.items():
            stream = self.streams.get(sid)
            if stream is not None:
                self._apply(stream, status, out)
        for sid, tokens in out.resident_tokens.items():
            if (stream := self.streams.get(sid)) is not None:
                stream.resident_tokens = tokens
        self._feed_all(out.finished_s)
        self.listeners.on_step(out)

    def _rebound(self, rebound: Rebound) -> None:
        """The engine bound a session under KV pressure: its stream and its owner learn of
        it (the server tells the client); its frames go on as before."""
        stream = self.streams.get(rebound.session_id)
        if stream is None:
            return
        stream.bound = rebound.policy
        self.listeners.on_rebound(rebound)
        self._tell_owner(stream, lambda owner: owner.on_rebound(rebound))

    def _apply(self, stream: Stream, status: WorkStatus, out: StepOutput) -> None:
        flight = stream.in_flight
        if status is WorkStatus.STALLED_KV:
            if flight is not None:
                self._answer(stream, flight, FrameStatus.STALLED_KV, out.finished_s,
                             "no free KV block")
        elif status is WorkStatus.CONTEXT_FULL:
            self._end(stream, out.finished_s, "max_session_tokens reached")
            return
        else:
            self._attribute(stream, out)
            self._context_in(stream, out.finished_s)
            flight = stream.in_flight
            if (flight is not None and stream.consumed_tokens >= flight.span[1]
                    and stream.id not in out.generating):
                self._answer(stream, flight, FrameStatus.OK, out.finished_s)
        self._advance(stream)

    def _attribute(self, stream: Stream, out: StepOutput) -> None:
        """The step's consumed input pays the backlog, then the frame in flight; its tokens
        are that frame's once its input is all consumed, else the last answered frame's."""
        consumed = out.consumed_tokens.get(stream.id, 0)
        stream.consumed(consumed)
        flight, new_ids = stream.in_flight, out.new_token_ids.get(stream.id, [])
        if (flight is not None and consumed and flight.start_s is None
                and stream.consumed_tokens > flight.span[0]):
            flight.start_s = out.started_s
        if flight is not None and stream.consumed_tokens >= flight.span[1]:
            flight.token_ids += new_ids
            if new_ids:
                if flight.first_output_s is None:
                    flight.first_output_s = out.finished_s
                self._tell_owner(stream, lambda owner: owner.on_tokens(flight, new_ids))
        elif stream.last_answered is not None and new_ids:
            stream.last_answered.late_token_ids += new_ids
            self.listeners.on_late_tokens(len(new_ids))

    def _end(self, stream: Stream, now_s: float, reason: str) -> None:
        """The engine ended the session (context full): it takes no more input."""
        stream.ended_reason = reason
        if stream.in_flight is not None:
            self._answer(stream, stream.in_flight, FrameStatus.CONTEXT_FULL, now_s, reason)
        for frame in self._waiting(stream):
            stream.frames.remove(frame)
            self._answer_unstarted(stream, frame, FrameStatus.REJECTED, now_s, reason)

    # ---- answers ------------------------------------------------------------------------
    def _answer(self, stream: Stream, frame: Frame, status: FrameStatus, now_s: float,
                reason: str = "") -> None:
        """Answer the frame in flight (its input stays in the stream, unless consumed)."""
        assert frame is stream.in_flight, (frame, stream)
        stream.in_flight = None
        stream.frames.remove(frame)
        if status is not FrameStatus.OK:
            self.run_on_engine(lambda: self.engine.cancel_generation(stream.id))
        stream.last_answered = frame
        self._deliver(stream, frame, status, now_s, reason)

    def _answer_unstarted(self, stream: Stream, frame: Frame, status: FrameStatus,
                          now_s: float, reason: str) -> None:
        """Answer a frame that never went in flight (no longer in `stream.frames`)."""
        frame.queued_ahead_tokens = stream.submitted_queued_tokens
        self._deliver(stream, frame, status, now_s, reason)

    def _deliver(self, stream: Stream, frame: Frame, status: FrameStatus, now_s: float,
                 reason: str) -> None:
        frame.status, frame.finish_s, frame.reason = status, now_s, reason
        stream.frames_answered += 1
        assert stream.frames_answered <= stream.frames_submitted, stream
        stream.recent_statuses.append(status)
        self.listeners.on_result(frame)
        self._tell_owner(stream, lambda owner: owner.on_result(frame))

    @staticmethod
    def _tell_owner(stream: Stream, call: Callable[[StreamOwner], None]) -> None:
        """The one place the beat calls a stream's owner: a failure there is that session's
        (logged, the owner told), never the beat's or another session's."""
        owner = stream.owner
        if owner is None:
            return
        try:
            call(owner)
        except Exception:
            log.exception("session %s failed on what the beat told it", stream.id)
            owner.on_failure()


def _count(token_ids: list[int] | torch.Tensor | None, embeddings: torch.Tensor | None) -> int:
    """Input positions of token ids or (n, hidden) embeddings (one of them, or neither)."""
    if token_ids is not None:
        return len(token_ids)
    return 0 if embeddings is None else int(embeddings.shape[0])


def _queue_full(stream: Stream, num_tokens: int) -> str:
    """Why a frame of `num_tokens` does not fit in the session's queued input."""
    return (f"input queue full: {stream.queued_input_tokens} tokens of this session's input "
            f"are not yet processed and this frame adds {num_tokens}; the limit is "
            f"{stream.profile.max_queued_input_tokens}")
