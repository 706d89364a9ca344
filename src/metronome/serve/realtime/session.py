"""One Realtime session: a dispatcher over its parts. Client events and turn events come in
here and each goes to the one part that owns it; frame results come back here from the beat
(the session is its stream's `StreamOwner`) and go to the reply they answer.

    client event ─► receive (parsed within the message limits) ─► handle ─┐
    turn event (server VAD, the detect stage) ─► handle_turn ─────────────┤
                                                                          ▼
    session.update          context    settings, KV bound, instructions (`context`)
    input_audio_buffer.*    buffer     append / commit / clear (`input_buffer`)
    conversation.item.*     buffer     text items; retrieve, truncate (the latest reply)
    response.create/cancel  replies    one `Reply` per response (`reply`)
                                   │
                                   ▼  intake: the one way into the `Stream` (accept ─►
                                      prepare on the hear stage ─► submit; its limits)
    beat ─► on_result(frame) ─► frame.tag (its Reply).answered ─► events ─► channel
         ─► on_tokens(frame)  ─► the Reply ─► its voice (the speak stage)

Its events leave through its `EventChannel` (`emitter`: numbered and kept, then to the
connection), and a client event it refuses is answered with an `error` there, the session
unchanged. What is refused by name: the GA client events the server parses and cannot carry
out (`UNSUPPORTED_EVENT_TYPES`). `metronome.*` events go only to a client that opted in
(`extensions`).

The session knows no socket and nothing of resuming: what its server hears of it (a client
event applied, a frame result settled, a live message to hold behind a take-over's replay)
goes through `SessionHooks` (`serve.resume`), and what it keeps across servers is `saved()`,
composed from its parts' own.

Modes: in duplex mode every audio frame is one response, so text streams back per frame with
no commit; in turn mode audio frames only prefill (no response) and a reply is the frame
that `response.create` submits. Mode and input rate are fixed once input has started. With
server VAD, a turn's end commits the buffer and, in turn mode with `create_response`,
creates a response, as the client's events would; speech that starts cancels the reply
under way (`interrupt_response`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from metronome.audio.frontend import AudioFrontEnd
from metronome.audio.turn_detector import SpeechPaused, SpeechStarted, SpeechStopped, TurnEvent
from metronome.engine.types import EngineFeature, Rebound
from metronome.observe.metrics import Metrics
from metronome.runtime.beat import Beat
from metronome.runtime.ports import Answer
from metronome.runtime.profile import SessionMode
from metronome.serve import protocol as p
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol import server as se
from metronome.serve.protocol.schema import ResumeOut
from metronome.serve.realtime.audio_input import AudioFramer
from metronome.serve.realtime.bound import BoundLimits
from metronome.serve.realtime.chat import ChatText, DeltaDecoder
from metronome.serve.realtime.context import Context
from metronome.serve.realtime.conversation import Conversation
from metronome.serve.realtime.emitter import Client, EventChannel, EventLog
from metronome.serve.realtime.input_buffer import InputBuffer, no_text
from metronome.serve.realtime.intake import Intake, token_tensor
from metronome.serve.realtime.rendering import CLIENT_CANCELLED, TURN_DETECTED, result_events
from metronome.serve.realtime.reply import Reply
from metronome.serve.realtime.settings import SessionSettings, checked_max_output_tokens
from metronome.serve.voice.hearing import Hearing
from metronome.serve.voice.pipeline import OUTPUT_RATE_HZ, VoiceStages
from metronome.serve.voice.speaking import Speaking
from metronome.serve.voice.turn_detection import TurnDetection
from metronome.stream import Frame, Stream

HELD_REASON = "client dropped: held for a resume"  # frames its lease answered `cancelled`

log = logging.getLogger(__name__)


class SessionHooks(Protocol):
    """What the server hears of a session beyond its events (`serve.resume.Resumer`)."""

    def received(self, session: RealtimeSession, text: str) -> bool:
        """A client message arrived: True if it is held (queued behind the client events a
        take-over still replays), False to apply it now."""

    def applied(self, session: RealtimeSession, event: p.ClientEvent,
                text: str | None) -> None:
        """The session applied a client event: a live one (`text`), or one replayed from a
        store's log (None: logged already)."""

    def settled(self, session: RealtimeSession) -> None:
        """A frame result of the session was handled."""


class Host(Protocol):
    """What a session uses of its server (`serve.serving.Serving`)."""

    @property
    def config(self) -> ServerConfig: ...

    @property
    def model_name(self) -> str: ...

    @property
    def chat(self) -> ChatText | None:
        """None: the model has no tokenizer (presets): audio only."""

    @property
    def beat(self) -> Beat:
        """The session's stream is in it."""

    @property
    def stages(self) -> VoiceStages: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def bound_limits(self) -> BoundLimits:
        """What a session's bound may be."""

    @property
    def hooks(self) -> SessionHooks: ...

    @property
    def accepts_audio(self) -> bool:
        """The engine takes the audio front end's embeddings."""

    def now_s(self) -> float: ...

    def observe_output_gap(self, gap_s: float) -> None:
        """A reply's listener ran dry for `gap_s` (admission's signal)."""

    def observe_input_behind(self, first: bool) -> None:
        """A session's real-time audio was kept past its buffer bound (admission's signal,
        a metric; `first`: a new stretch behind)."""

    def frontend(self, sample_rate_hz: int) -> AudioFrontEnd: ...


# The GA client events this server parses and cannot carry out, each refused by name
# (`ErrorCode.UNSUPPORTED`) with why (docs/serving.md's protocol table lists the same).
_UNSUPPORTED = {
    "conversation.item.delete": (
        "an item cannot leave the model's context once it is in the session's KV (written "
        "in order; it leaves as the window slides past it)", "item_id"),
    "output_audio_buffer.clear": (
        "no audio is produced, so there is no output audio buffer (OpenAI has it on WebRTC "
        "and SIP only)", None),
}
UNSUPPORTED_EVENT_TYPES = frozenset(_UNSUPPORTED)


def unsupported(event: p.ClientEvent) -> ClientError:
    message, param = _UNSUPPORTED[event.type]
    return ClientError(ErrorCode.UNSUPPORTED, f"{event.type} is not supported here: {message}",
                       param)


class RealtimeSession:
    def __init__(self, host: Host, client: Client, extensions: bool = False,
                 saved: dict | None = None, stream: Stream | None = None) -> None:
        """A new session, its events to `client`; or, with `saved` (`saved()`, from a
        checkpoint), the one it describes, continuing `stream`, which the server restored
        in its engine."""
        self.id = p.new_id("sess") if saved is None else saved["id"]
        self.host = host
        config = host.config
        self.channel = EventChannel(EventLog(config.max_outbox_events, config.max_outbox_bytes),
                                    client)
        self.extensions = extensions  # the client opted in to `metronome.*` events
        self.opened_at_s = host.now_s() - (0.0 if saved is None else saved["age_s"])
        self.resume_offer: ResumeOut | None = None  # how its client resumes it (its token)
        self.closed = False
        settings = SessionSettings.defaults(config, host.stages.speaks) if saved is None else (
            SessionSettings.load(saved["settings"]))
        # ---- its parts -----------------------------------------------------------------------
        if stream is None:
            stream = self._new_stream(settings.mode)
            host.beat.add(stream)
        else:
            assert saved is not None and stream.id == self.id
            stream.owner = self
            host.beat.adopt(stream)
        self.intake = Intake(self, host.beat, host.stages.hear, host.now_s, stream,
                             config.frame_period_s, config.max_buffered_audio_s,
                             config.max_text_chars, config.max_behind_audio_s)
        self.context = Context(self.id, self.intake, host.bound_limits, host.chat, settings)
        self.conversation = Conversation()
        self.buffer = InputBuffer(
            self.intake, self.context, self.conversation, self.channel,
            AudioFramer(host.frontend(settings.sample_rate_hz), config.frame_period_s),
            self._new_hearing(settings), host.accepts_audio)
        self.decoder: DeltaDecoder | None = host.chat.decoder() if host.chat else None
        self.reply: Reply | None = None  # `response.create`'s under way, one at a time
        self.last_reply: Reply | None = None  # what a conversation.item.truncate may cut
        self.turns: TurnDetection | None = None  # server VAD; None: the client commits
        self._turns_for: tuple[p.ServerVad | None, int] | None = None  # its settings, rate
        if saved is not None:
            self._load(saved)
        self.set_turns(settings.turns)  # a restored session's listens afresh from here

    def _new_stream(self, mode: SessionMode) -> Stream:
        """This session's stream for `mode`, opened now."""
        return Stream(self.id, self.host.config.profile(mode), self.host.now_s(), owner=self)

    def _new_hearing(self, settings: SessionSettings) -> Hearing | None:
        """Whisper's ears for a turn session on a server that hears (duplex sessions take
        the embedding front end: one KV entry per audio token, as an omni encoder)."""
        whisper = self.host.stages.hear.model
        if whisper is None or settings.mode is not SessionMode.TURN:
            return None
        return Hearing(whisper, settings.sample_rate_hz)

    @property
    def stream(self) -> Stream:
        return self.intake.stream

    @property
    def settings(self) -> SessionSettings:
        return self.context.settings

    def emit(self, event: p.ServerEvent) -> None:
        self.channel.emit(event)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.emit(se.SessionCreated(session=self.describe()))

    def close(self) -> None:
        """Answer what is owed (`cancelled`) and give the stream's blocks back now; input
        still being prepared is dropped when it comes back."""
        self.closed = True
        if self.turns is not None:
            self.turns.stop()
        if self.reply is not None:
            self.reply.stop_voice(None)
        self.host.beat.close(self.stream, self.host.now_s())

    def stop_generating(self) -> None:
        """Its client dropped and it is held for a resume: every frame it owes (the reply
        under way, spoken or not, and its queued input's frames) is answered `cancelled`
        where it got to, its events kept for the resume, and its input waits in the stream,
        unfed, until `resume_generating` (`Beat.hold`): a dropped client keeps no engine or
        voice busy for the grace, and loses no input."""
        if self.reply is not None and self.reply.speaking:
            self.reply.stop_voice(CLIENT_CANCELLED)
        self.host.beat.hold(self.stream, self.host.now_s(), HELD_REASON)

    def resume_generating(self) -> None:
        """Its client is back: its input is fed again."""
        self.host.beat.release(self.stream, self.host.now_s())

    def on_failure(self) -> None:
        """A bug in this session: its connection ends it (1011), or its lease ends."""
        self.channel.fail()

    def input_behind(self, unanswered_s: float, ahead_s: float, first: bool) -> None:
        """The server fell behind this client's real-time audio (`Intake.check_audio_room`):
        counted, admission's signal, and a client that opted in is told once a stretch."""
        self.host.observe_input_behind(first)
        if first:
            log.warning("session %s: %.1f s of its real-time audio unanswered: the server is "
                        "behind", self.id, unanswered_s)
            if self.extensions:
                self.emit(se.MetronomeInputBehind(behind=se.BehindOut(
                    unanswered_audio_s=round(unanswered_s, 3),
                    ahead_of_real_time_s=round(ahead_s, 3),
                    kept_up_to_s=self.host.config.max_behind_audio_s)))

    # ---- client events -----------------------------------------------------------------------
    def receive(self, text: str) -> None:
        """A client message (JSON text within the size limit): applied, unless its server
        holds it behind the client events a take-over still replays."""
        if not self.host.hooks.received(self, text):
            self.apply(text)

    def reading_paused(self) -> asyncio.Future[None] | None:
        """Its connection reads the next message once this is done (None: at once): while
        its text being tokenized decides whether more fits (`Intake.reading_paused`)."""
        return self.intake.reading_paused()

    def apply(self, text: str, logged: bool = False) -> None:
        """Apply one client event; `logged`: replayed from the store's log (numbered and
        logged already: counted as applied wherever it lands). A refusal is an `error`."""
        config = self.host.config
        try:
            event = p.parse_client_event(text, config.max_message_values,
                                         config.max_message_depth)
        except ClientError as err:
            self.channel.refuse(err)
            return
        if logged:
            self.host.hooks.applied(self, event, None)
        try:
            self.handle(event)
        except ClientError as err:
            err.event_id = event.event_id
            self.channel.refuse(err)
            return
        if not logged:
            self.host.hooks.applied(self, event, text)

    def handle(self, event: p.ClientEvent) -> None:
        match event:
            case p.SessionUpdate():
                self._update(event.session)
            case p.InputAudioBufferAppend():
                self._listen(self.buffer.append(event.audio))
            case p.InputAudioBufferCommit():
                self.buffer.commit()
            case p.InputAudioBufferClear():
                self.buffer.clear()
                if self.turns is not None:  # speech under way is forgotten
                    self.set_turns(None)
                    self.set_turns(self.settings.turns)
            case p.ConversationItemCreate():
                self.buffer.create_item(event)
            case p.ConversationItemRetrieve():
                self.emit(se.ConversationItemRetrieved(item=self.conversation.get(event.item_id)))
            case p.ConversationItemTruncate():
                self._truncate(event)
            case p.ConversationItemDelete():
                self.conversation.get(event.item_id)  # item_not_found first
                raise unsupported(event)
            case p.OutputAudioBufferClear():
                raise unsupported(event)
            case p.ResponseCreate():
                self._create_response(event.response or p.ResponseParamsIn())
            case p.ResponseCancel():
                self._cancel_response(event.response_id)

    def _update(self, update: p.SessionIn) -> None:
        """`session.update`: checked whole (`Context.plan`), then applied part by part."""
        host, context = self.host, self.context
        change = context.plan(update, host.config, host.stages.speaks, host.stages.hears)
        current = context.settings
        if (change.settings.mode, change.settings.sample_rate_hz) != (
                current.mode, current.sample_rate_hz):
            self._reconfigure(change.settings)
        context.set_bound(change.bound)
        if change.instructions is not None and change.instruction_ids is not None:
            context.instruct(change.instructions, change.instruction_ids)
        context.settings = change.settings
        self.set_turns(change.settings.turns)
        context.tell_not_honored(change.not_honored)
        self.emit(se.SessionUpdated(session=self.describe()))

    def _reconfigure(self, settings: SessionSettings) -> None:
        """A new mode or input rate, before any input: a fresh stream for a new mode, new
        framing and ears."""
        if self.intake.started or self.buffer.framer.received_bytes:
            raise ClientError(ErrorCode.SESSION_LOCKED,
                              "mode and input format are fixed once input has started",
                              "session")
        host = self.host
        if settings.mode is not self.settings.mode:  # nothing submitted: a fresh stream
            host.beat.close(self.stream, host.now_s())
            self.intake.stream = self._new_stream(settings.mode)
            host.beat.add(self.intake.stream)
        self.context.settings = settings
        self.buffer.reconfigured(AudioFramer(host.frontend(settings.sample_rate_hz),
                                             host.config.frame_period_s),
                                 self._new_hearing(settings))

    def _truncate(self, event: p.ConversationItemTruncate) -> None:
        """`conversation.item.truncate`: errors as OpenAI's (an unknown item, a user item, a
        content index or time past the item's end), and here an engine that cannot rewind,
        or an item that is not the latest reply any more (nothing changed); else the reply
        cuts itself (`Reply.truncate`)."""
        decode = self._chat().decode
        item = self.conversation.get(event.item_id)
        if item.role != "assistant":
            raise ClientError(ErrorCode.INVALID_VALUE, f"item {item.id!r} is a {item.role} "
                              "item: only assistant items can be truncated", "item_id")
        if event.content_index >= max(1, len(item.content)):
            raise ClientError(ErrorCode.INVALID_VALUE, f"item {item.id!r} has "
                              f"{len(item.content)} content part(s); content_index "
                              f"{event.content_index} is past them", "content_index")
        if not self.host.beat.serves(EngineFeature.REWIND):
            raise ClientError(ErrorCode.UNSUPPORTED, "this server's engine (vLLM) cannot "
                              "rewind a streaming request: its KV only grows (vLLM would have "
                              "to abort the request and prefill the whole context again)",
                              "item_id")
        reply = self.last_reply
        if reply is None or reply.item_id != item.id:
            raise ClientError(ErrorCode.INVALID_VALUE, f"item {item.id!r} can no longer be "
                              "truncated: only the session's latest reply can, until its next "
                              "input is in the context", "item_id")
        reply.truncate(event, decode)

    def _create_response(self, params: p.ResponseParamsIn) -> None:
        chat = self._chat()
        if self.reply is not None:
            raise ClientError(ErrorCode.ACTIVE_RESPONSE, f"response "
                              f"{self.reply.response_id} is still in progress")
        if params.conversation not in (None, "auto") or params.input is not None:
            raise ClientError(ErrorCode.UNSUPPORTED, "out-of-band responses are not served: "
                              "a response continues the session's one conversation (its KV)",
                              "response.conversation" if params.input is None
                              else "response.input")
        if params.instructions is not None:  # in the context, not a conversation item, as
            self.intake.queue_text(chat, "system", params.instructions,  # OpenAI keeps them
                                   "response.instructions")
        # no frame-count check: one client response at a time bounds these frames already
        # (audio appended and committed just before, as clients do, must not refuse it)
        ids = chat.response_prefix_ids
        self.intake.check_input_room(len(ids), "response", ErrorCode.TOO_MANY_PENDING)
        budget = self.settings.reply_budget_tokens(self.host.config, checked_max_output_tokens(
            params.max_output_tokens, "response.max_output_tokens"))
        reply = self._open_reply(params.metadata,
                                 spoken=self.settings.speak and self.host.stages.speaks)
        self.reply = reply
        reply.frame = self.intake.queue("response", lambda: token_tensor(ids), len(ids),
                                        respond=True, reply=reply, output_budget_tokens=budget,
                                        paced=self.settings.mode is SessionMode.TURN)

    def _open_reply(self, metadata: dict[str, str] | None = None,
                    spoken: bool = False) -> Reply:
        reply = Reply(self, p.new_id("resp"), p.new_id("item"), self.conversation.last_item_id,
                      metadata)
        if spoken:
            reply.voice = Speaking(self.host.stages.speak, OUTPUT_RATE_HZ, reply,
                                   by_deadline=self.host.config.speak_order == "deadline")
        reply.open()
        return reply

    def _cancel_response(self, response_id: str | None) -> None:
        """Cancel a response under way: the client's (`response.create`, or server VAD's), or,
        by id, a duplex frame's."""
        reply = self.reply
        if reply is not None and response_id in (None, reply.response_id):
            reply.cancel(CLIENT_CANCELLED)
            return
        for frame in self.stream.frames:
            if frame.tag is not None and frame.tag.response_id == response_id:
                self.cancel_frame(frame, CLIENT_CANCELLED)
                return
        raise ClientError(ErrorCode.RESPONSE_NOT_ACTIVE, "no response in progress" + (
            f" with id {response_id!r}" if response_id else ""), "response_id")

    def _chat(self) -> ChatText:
        if self.host.chat is None:
            raise no_text()
        return self.host.chat

    # ---- turn events (server VAD) ------------------------------------------------------------
    def set_turns(self, turns: p.ServerVad | None) -> None:
        """Start, restart (new settings or rate) or stop server VAD from where audio stands."""
        rate_hz = self.settings.sample_rate_hz
        if self.turns is not None and self._turns_for == (turns, rate_hz):
            return  # the same settings again: the speech under way goes on
        if self.turns is not None:
            self.turns.stop()
        self.buffer.speech_item_id = None  # the item of speech the old detection heard
        self.turns = None if turns is None else TurnDetection(
            self.host.stages.detect, rate_hz, turns.threshold, turns.silence_duration_ms,
            self.buffer.framer.received_ms, self.host.config.hear_ahead_pause_ms or None,
            1000 * self.host.config.max_turn_s)
        self._turns_for = (turns, rate_hz)

    def _listen(self, pcm: bytes) -> None:
        """Appended audio to server VAD; its turn events come back to `handle_turn`."""
        turns = self.turns
        if turns is not None:
            turns.push(pcm).add_done_callback(lambda done: self._heard_turns(turns, done))

    def _heard_turns(self, turns: TurnDetection, done: asyncio.Future[list[TurnEvent]]) -> None:
        if turns.stopped or done.cancelled():
            return  # new settings or a closed session: these turns are moot
        error = done.exception()
        if error is not None:
            log.error("session %s: server VAD failed", self.id, exc_info=error)
            turns.stop()
            self.on_failure()
            return
        for event in done.result():
            if turns.stopped:  # a turn's handling may end the session
                return
            self.handle_turn(event)

    def handle_turn(self, event: TurnEvent) -> None:
        """A turn event, dispatched as a client event is: speech started (the item it will
        become; `interrupt_response` cancels the reply under way), speech stopped (the turn
        committed and, if it should, answered)."""
        vad, buffer = self.settings.turns, self.buffer
        assert vad is not None, "turn events come only while server VAD is on"
        match event:
            case SpeechStarted():
                item_id = buffer.speech_item_id = p.new_id("item")
                start_ms = max(buffer.committed_ms, event.start_ms - vad.prefix_padding_ms)
                self.emit(se.InputAudioBufferSpeechStarted(audio_start_ms=round(start_ms),
                                                           item_id=item_id))
                if buffer.hearing is not None:  # the turn Whisper hears starts there
                    buffer.speech_from_ms = start_ms
                if vad.interrupt_response and self.reply is not None and not event.continues:
                    self.reply.cancel(TURN_DETECTED)  # (speech past the turn limit answered
                    # goes on: it does not barge in on its own answer)
            case SpeechPaused():  # the turn may end here: its last pass runs now
                buffer.hear_ahead()
            case SpeechStopped():
                item_id = buffer.speech_item_id or p.new_id("item")  # or a commit took it
                end_ms = event.end_ms + (0 if event.at_limit else vad.silence_duration_ms)
                self.emit(se.InputAudioBufferSpeechStopped(audio_end_ms=round(end_ms),
                                                           item_id=item_id))
                if buffer.hearing is not None:  # before the silence that confirmed it
                    buffer.speech_end_ms = event.end_ms
                if not buffer.holds_audio:
                    return  # the client committed this speech already
                buffer.commit(item_id)
                # speech past the turn limit, stopped (at the limit again, or at a silence)
                # while its answer still plays: committed, answered with the next turn (no
                # error for a client that did nothing)
                answering = (event.at_limit or event.continued) and self.reply is not None
                if vad.create_response and self.settings.mode is SessionMode.TURN and (
                        not answering):
                    self._respond_to_turn()

    def _respond_to_turn(self) -> None:
        """`response.create` on the client's behalf; what would refuse it is told as an
        `error` (e.g. a response still under way with interrupt_response off)."""
        try:
            self._create_response(p.ResponseParamsIn())
        except ClientError as err:
            self.emit(p.ErrorEvent.of(err))

    # ---- frames (`IntakeOwner`, `StreamOwner`, `ReplyOwner`) -----------------------------------
    def input_prepared(self, frame: Frame[Reply]) -> None:
        """A duplex frame's input is ready: it opens its reply now."""
        if frame.tag is None and frame.expects_output:
            frame.tag = self._open_reply()
            frame.tag.frame = frame

    def on_result(self, frame: Frame[Reply]) -> None:
        """The beat answered a frame: the reply it answers takes it; a frame without one
        (turn-mode prefill, a text item) is its `metronome.frame` alone."""
        if frame.tag is not None:
            frame.tag.answered(frame)
            return
        text = self.text_of(frame.token_ids, flush=frame.kind == "response")
        for event in result_events(frame, None, text, self.extensions):
            self.emit(event)
        self.host.hooks.settled(self)

    def on_tokens(self, frame: Frame[Reply], token_ids: list[int]) -> None:
        if frame.tag is not None:
            frame.tag.on_tokens(token_ids)

    def on_rebound(self, rebound: Rebound) -> None:
        """The engine changed this session's bound (KV pressure, the position limit, a
        re-pin): tell a client that opted in."""
        self.context.on_rebound(rebound)
        if self.extensions:
            self.emit(se.MetronomeSessionBounded(session_id=self.id, bound=se.BoundOut(
                policy=str(rebound.policy), reason=rebound.reason,
                freed_blocks=rebound.freed_blocks,
                resident_kv_tokens=rebound.resident_tokens)))

    def reply_closed(self, reply: Reply) -> None:
        """`reply`'s last event went out: it is the latest (a truncate may cut it), and the
        client may ask for the next."""
        self.last_reply = reply
        if reply is self.reply:
            self.reply = None
        self.host.hooks.settled(self)

    def text_of(self, token_ids: list[int], flush: bool) -> str:
        if self.decoder is None:
            return ""
        text = self.decoder.push(token_ids)
        return text + self.decoder.flush() if flush else text

    def cancel_frame(self, frame: Frame[Any], reason: str) -> None:
        self.host.beat.cancel(frame, self.host.now_s(), reason)

    def rewind(self, keep_tokens: int) -> Answer[int]:
        return self.host.beat.rewind_reply(self.stream, keep_tokens)

    def observe_lm(self, seconds: float) -> None:
        self.host.metrics.observe_voice_stage("lm", seconds)

    def observe_reply(self, reply: Reply) -> None:
        self.host.metrics.observe_reply(reply.playback.gap_ms, spoken=reply.voice is not None)

    def now_s(self) -> float:
        return self.host.now_s()

    def observe_output_gap(self, gap_s: float) -> None:
        self.host.observe_output_gap(gap_s)

    @property
    def text_pace_tokens_per_s(self) -> float:
        return self.host.config.text_pace_tokens_per_s

    @property
    def stop_token_ids(self) -> frozenset[int]:
        chat = self.host.chat
        return frozenset() if chat is None else chat.stop_token_ids

    # ---- a checkpoint ------------------------------------------------------------------------
    @property
    def quiescent(self) -> bool:
        """Nothing of it under way on the loop, a stage or the beat: a checkpoint may be
        taken (the engine side is checked on the engine thread: nothing still generating)."""
        stream = self.stream
        return (not self.closed and not stream.frames and stream.queued_input_tokens == 0
                and self.reply is None and not stream.ended_reason
                and (self.buffer.hearing is None or not self.buffer.holds_audio))

    def saved(self) -> dict:
        """Everything a server needs, beside the engine's snapshot of its stream, to go on
        with this session another server held, from its parts: its settings, bound and
        instructions (the context), conversation items, frame numbering (and KV bound, if
        pressure imposed one), event numbering, audio framing and the encoder's stream
        context (the buffer), the text decoder's held tokens, its latest reply. Taken only
        while quiescent, so nothing in flight is lost by leaving it out. Server VAD is not
        carried: it listens afresh from the restored position."""
        assert self.quiescent
        stream = self.stream
        return {
            "id": self.id, "extensions": self.extensions,
            "age_s": self.host.now_s() - self.opened_at_s, "started": self.intake.started,
            "frames_submitted": stream.frames_submitted,
            "bound": None if stream.bound is None else str(stream.bound),
            "next_event_seq": self.channel.log.next_seq,
            "conversation": self.conversation.saved(),
            "decoder_held_ids": [] if self.decoder is None else self.decoder.held_ids,
            "last_reply": None if self.last_reply is None else self.last_reply.saved(),
        } | self.context.saved() | self.buffer.saved()

    def _load(self, saved: dict) -> None:
        """`saved()`'s state onto this session, just built (its id, settings and stream
        set: the stream's frame numbering and bound are the restorer's)."""
        self.intake.started = saved["started"]
        self.channel.log.next_seq = saved["next_event_seq"]
        self.conversation.load(saved["conversation"])
        self.buffer.load(saved)
        if self.decoder is not None:
            self.decoder.hold(saved["decoder_held_ids"])
        self.context.load(saved)
        reply = saved.get("last_reply")
        self.last_reply = None if reply is None else Reply.saved_reply(self, reply)

    # ---- descriptions ------------------------------------------------------------------------
    def describe(self) -> p.SessionOut:
        host, context = self.host, self.context
        return context.settings.describe(
            self.id, host.model_name, self.stream.profile, self.stream.policy,
            host.config.token_rate_hz, context.instructions, self.extensions,
            self.resume_offer,
            context.bound.describe(host.bound_limits))

    def summary(self, now_s: float) -> dict:
        """What `GET /v1/sessions` shows of this session (the server adds its connection)."""
        stream, settings = self.stream, self.settings
        last = stream.last_status
        return {
            "id": self.id, "status": "ended" if stream.ended_reason else "active",
            "ended_reason": stream.ended_reason or None, "mode": settings.mode.value,
            "policy": str(stream.policy), "sample_rate_hz": settings.sample_rate_hz,
            "age_s": round(now_s - self.opened_at_s, 3),
            "resident_kv_tokens": stream.resident_tokens,
            "frames_submitted": stream.frames_submitted,
            "frames_answered": stream.frames_answered,
            "last_frame_status": None if last is None else last.value,
            "unanswered_frames": stream.unanswered_frames,
            "queued_input_tokens": stream.queued_input_tokens,
        }
