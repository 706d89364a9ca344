"""One Realtime session: client events in, frames to the beat, frame results out as events.

Owns what the client's events do to the session (items, commits, responses; the limits on
its input are `serve.edge.input_limits`') and its frames on the server side: each is accepted in
the beat's session record (`Beat.accept`: the record counts it and its input from then on,
and the limits read the record, never a count of their own), its input made on the encoder
thread, then submitted; what it belongs to (its `FrameOrigin`) is kept here by frame index until its
result comes back and is rendered into events (`serve.events`). Its settings are
`serve.settings`, its audio framing `serve.audio_input`, its server VAD
`serve.turn_detection`. No socket here: events come in through `handle` (already parsed),
go out through `emit`, and `ClientError` means "answer with an error, the session is
unchanged". The host (`serve.state`) provides the beat, the clock and the encoder
thread: audio is cut into frames on the loop and encoded there, off the loop; text is
tokenized there, its room checked first against the most tokens it can make.

Responses: a frame whose profile asks for output is one response (opened at submit, closed
when the beat answers it: `serve.events` has the events and their order). In duplex mode
that is every frame, so text streams back per frame with no commit; in turn mode audio
frames only prefill (no response) and a reply is the frame that `response.create` submits.
Mode and input rate are fixed once input has started: the engine session's profile is.
With server VAD, a turn's end commits the buffer and, in turn mode with
`create_response`, creates a response, as the client's events would. `response.cancel`
cancels a response's frame in the beat (`client_cancelled`); items only join the
conversation at its end (`serve.conversation`); what the GA API has and the server cannot do
(deleting or truncating an item already in the KV, audio output) is refused by name.
`metronome.*` events go only to a client that opted in (`extensions`).

Every event the session emits goes through its `EventChannel`: numbered and kept, then to
the connection, so a client that drops and resumes (`serve.resume`) gets what it missed: a
dropped session is detached (the state leases it) and a resume attaches it to the new
connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from metronome.engine.types import Rebound
from metronome.runtime.frame import Frame, FrameResult
from metronome.runtime.profile import SessionMode
from metronome.runtime.record import Accepted, SessionRecord
from metronome.serve import protocol as p
from metronome.serve.audio_input import AudioFramer, PcmCut, decode_pcm16
from metronome.serve.conversation import Conversation
from metronome.serve.edge.input_limits import (
    check_audio_room,
    check_input_room,
    check_room_for_a_frame,
    check_text_length,
)
from metronome.serve.event_stream import EventChannel, EventStream, Sink
from metronome.serve.events import (
    CLIENT_CANCELLED,
    TURN_DETECTED,
    FrameKind,
    FrameOrigin,
    ResponseHandle,
    assistant_item,
    response_opened,
    result_events,
)
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol import server as se
from metronome.serve.protocol.schema import ResumeOut
from metronome.serve.protocol.server import BoundOut, MetronomeSessionBounded
from metronome.serve.refusals import unsupported
from metronome.serve.session_checkpoint import load_state
from metronome.serve.session_host import Input, SessionHost
from metronome.serve.session_view import summary
from metronome.serve.settings import SessionSettings
from metronome.serve.text import ChatText
from metronome.serve.turn_detection import TurnDetection

log = logging.getLogger(__name__)


class RealtimeSession:
    def __init__(self, host: SessionHost, sink: Sink, on_failure: Callable[[], None],
                 extensions: bool = False, saved: dict | None = None,
                 engine_session_id: int | None = None) -> None:
        """A new session; or, with `saved` (`saved_state`, from a checkpoint), the one it
        describes, continuing the engine session `engine_session_id` the host restored."""
        self.id, self.host = p.new_id("sess") if saved is None else saved["id"], host
        config = host.config
        # Its events, numbered and kept for a resume, to its client's connection; a bug in
        # this session (`on_failure`): the connection ends it (1011), or its lease ends.
        self.channel = EventChannel(EventStream(config.max_outbox_events,
                                                config.max_outbox_bytes), sink, on_failure)
        self.emit = self.channel.emit
        self.on_failure = self.channel.fail
        self.extensions = extensions  # the client opted in to `metronome.*` events
        self.resume: ResumeOut | None = None  # how its client resumes it (`serve.resume`)
        self.settings = SessionSettings.defaults(config) if saved is None else (
            SessionSettings.load(saved["settings"]))
        self.profile = config.profile(self.settings.mode)
        self.opened_at_s = host.now_s() - (0.0 if saved is None else saved["age_s"])
        self.client_seq = 0  # client events applied (`serve.checkpoint` logs them by it)
        self.last_client_event_id: str | None = None  # the last one's
        if saved is None:
            self.engine_session_id = self._open_engine_session()
        else:
            assert engine_session_id is not None
            self.engine_session_id = engine_session_id
            host.adopt_session(self.profile, self.id, engine_session_id, self._on_result_guarded,
                               self._on_rebound, saved["frames_submitted"], saved["bound"])
        self.framer = AudioFramer(host.frontend(self.settings.sample_rate_hz),
                                  config.frame_period_s)
        self.decoder = host.chat.decoder() if host.chat else None
        self.started = False  # input has reached the engine: mode and rate are fixed
        self.closed = False
        self._origins: dict[int, FrameOrigin] = {}  # frame index -> its origin, until answered
        self.appended_since_commit_bytes = 0
        self.committed_ms = 0.0  # input stream position of the last commit
        self.conversation = Conversation()
        self._client_response: ResponseHandle | None = None
        self._client_response_index: int | None = None  # its frame, once in the beat
        self._cancel_pending: str | None = None  # cancel it (this reason) once in the beat
        self.told_not_honored: set[str] = set()  # logged once per session
        self.instructions: str | None = None
        self.turns: TurnDetection | None = None  # server VAD; None: the client commits
        if saved is not None:
            load_state(self, saved)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self.emit(se.SessionCreated(session=self.describe()))

    def close(self) -> None:
        """Answer what is owed (`cancelled`) and give the engine session's blocks back now;
        audio still being encoded is dropped when it comes back."""
        self.closed = True
        if self.turns is not None:
            self.turns.stop()
        self.host.close_session(self.engine_session_id)

    def _open_engine_session(self) -> int:
        return self.host.open_session(self.profile, self.id, self._on_result_guarded,
                                      self._on_rebound)

    def _on_rebound(self, rebound: Rebound) -> None:
        """The engine bound this session under KV pressure: tell a client that opted in."""
        if self.extensions:
            self.emit(MetronomeSessionBounded(session_id=self.id, bound=BoundOut(
                policy=str(rebound.policy), freed_blocks=rebound.freed_blocks,
                resident_kv_tokens=rebound.resident_tokens)))

    @property
    def record(self) -> SessionRecord:
        """The beat's record of this session: its frames and their input, counted there."""
        return self.host.record(self.engine_session_id)

    # ---- client events -----------------------------------------------------------------
    def handle(self, event: p.ClientEvent) -> None:
        match event:
            case p.SessionUpdate():
                self._update(event.session)
            case p.InputAudioBufferAppend():
                self._append(event.audio)
            case p.InputAudioBufferCommit():
                self._commit()
            case p.InputAudioBufferClear():
                self._clear_buffer()
            case p.ConversationItemCreate():
                self._create_item(event)
            case p.ConversationItemRetrieve():
                self.emit(se.ConversationItemRetrieved(item=self.conversation.get(event.item_id)))
            case p.ConversationItemDelete() | p.ConversationItemTruncate():
                self.conversation.get(event.item_id)  # item_not_found first
                raise unsupported(event)
            case p.OutputAudioBufferClear():
                raise unsupported(event)
            case p.ResponseCreate():
                self._create_response(event.response or p.ResponseParamsIn())
            case p.ResponseCancel():
                self._cancel_response(event.response_id)

    def _update(self, update: p.SessionIn) -> None:
        settings = self.settings.updated(update, self.host.config, self.host.chat is not None)
        instructions = update.instructions
        new_instructions = instructions is not None and instructions != self.instructions
        if new_instructions:  # refused before anything changes
            check_text_length(instructions, self.host.config.max_text_chars,
                              "session.instructions")
        current = self.settings
        if (settings.mode, settings.sample_rate_hz) != (current.mode, current.sample_rate_hz):
            self._reconfigure(settings)
        not_honored = update.not_honored()
        if new_instructions:
            if self.host.chat is None:
                not_honored.append("instructions (the model has no tokenizer)")
            else:
                self._instruct(instructions)
        self.settings = settings
        self.set_turns(settings.turns)
        self._tell_not_honored(not_honored)
        self.emit(se.SessionUpdated(session=self.describe()))

    def _instruct(self, instructions: str) -> None:
        """Instructions are a system message at this point of the conversation (a KV is
        written in order: earlier ones stay until the window slides past them)."""
        self._queue_text("system", instructions, "session.instructions", content_type=None)
        self.instructions = instructions

    def _tell_not_honored(self, fields: list[str]) -> None:
        new = [name for name in fields if name not in self.told_not_honored]
        if new:
            log.info("session %s: accepted and not acted on (the served model cannot): %s",
                     self.id, ", ".join(new))
            self.told_not_honored.update(new)

    def set_turns(self, turns: p.ServerVad | None) -> None:
        """Start, restart (new settings or rate) or stop server VAD from where audio stands."""
        current, rate_hz = self.turns, self.settings.sample_rate_hz
        if current is not None and (current.settings, current.sample_rate_hz) == (
                turns, rate_hz):
            return  # the same settings again: the speech under way goes on
        if current is not None:
            current.stop()
        self.turns = None if turns is None else TurnDetection(
            turns, self.host, rate_hz, self.framer.received_ms, self, self.on_failure)

    def _reconfigure(self, settings: SessionSettings) -> None:
        if self.started or self.framer.received_bytes:
            raise ClientError(ErrorCode.SESSION_LOCKED,
                              "mode and input format are fixed once input has started",
                              "session")
        if settings.mode is not self.settings.mode:  # nothing submitted: a fresh session
            self.host.close_session(self.engine_session_id)
            self.profile = self.host.config.profile(settings.mode)
            self.engine_session_id = self._open_engine_session()
        self.framer = AudioFramer(self.host.frontend(settings.sample_rate_hz),
                                  self.host.config.frame_period_s)

    def _append(self, audio_b64: str) -> None:
        if not self.host.accepts_audio:
            raise ClientError(ErrorCode.AUDIO_UNSUPPORTED, "this server's engine takes text "
                              "only (vLLM's streaming input refuses embeddings): send text "
                              "items with conversation.item.create", "audio")
        # what it decodes to, at least: a chunk that cannot fit is refused before decoding
        # (~3 ms of loop time per MiB)
        framer, config = self.framer, self.host.config
        check_audio_room(self.record, framer, config, max(0, len(audio_b64) // 4 * 3 - 2))
        pcm = decode_pcm16(audio_b64)
        check_audio_room(self.record, framer, config, len(pcm))
        self.appended_since_commit_bytes += len(pcm)
        for cut in framer.cut(pcm):
            self._encode_then_submit(cut)
        if self.turns is not None:
            self.turns.push(pcm)

    def _commit(self, item_id: str | None = None) -> None:
        """The buffer becomes a user item: `item_id` (a turn's), the speech under way's, or a
        new one."""
        if not self.appended_since_commit_bytes:
            raise ClientError(ErrorCode.COMMIT_EMPTY, "no audio appended since the last commit")
        self.appended_since_commit_bytes = 0
        self.committed_ms = self.framer.received_ms
        self._encode_then_submit(self.framer.cut_rest())
        # a commit mid-speech takes the turn's item id with it
        turn_item_id = self.turns.take_item_id() if self.turns is not None else None
        item_id = item_id or turn_item_id or p.new_id("item")
        item = se.ItemOut(id=item_id, role="user",
                          content=[se.ContentOut(type="input_audio")])
        self.emit(se.InputAudioBufferCommitted(item_id=item.id,
                                               previous_item_id=self.conversation.last_item_id))
        self._add_item(item)

    def _clear_buffer(self) -> None:
        """Audio appended and not yet cut into a frame is dropped; frames already in the beat
        are the conversation's (a KV is written in order)."""
        self.framer.clear_pending()
        self.appended_since_commit_bytes = 0
        if self.turns is not None:
            self.set_turns(None)
            self.set_turns(self.settings.turns)  # speech under way is forgotten
        self.emit(se.InputAudioBufferCleared())

    def _create_item(self, event: p.ConversationItemCreate) -> None:
        item = event.item
        if item.type != "message":
            raise ClientError(ErrorCode.UNSUPPORTED, f"{item.type} items are not served: the "
                              "served model calls no tools", "item.type")
        served = "output_text" if item.role == "assistant" else "input_text"
        for index, part in enumerate(item.content):
            if part.type != served or part.text is None:
                raise ClientError(ErrorCode.UNSUPPORTED, f"a {item.role} item's content is "
                                  f"{served} with text here (got {part.type}); send audio with "
                                  "input_audio_buffer.append", f"item.content[{index}]")
        self.conversation.check_append(event.previous_item_id, item.id)
        text = "".join(part.text for part in item.content)
        self._queue_text(item.role, text, "item.content", item.id, served)

    def _queue_text(self, role: str, text: str, param: str, item_id: str | None = None,
                    content_type: str | None = "input_text") -> None:
        """A text message into the model's context: a frame of its tokens and, unless
        `content_type` is None (instructions: in the context, not a conversation item, as
        OpenAI keeps them), an item."""
        chat = self._chat()
        config = self.host.config
        check_text_length(text, config.max_text_chars, param)
        check_room_for_a_frame(self.record, config.frame_period_s, config.max_buffered_audio_s)
        # Nothing is tokenized on the loop: the room is checked against the most tokens the
        # text can make (`ChatText.max_item_tokens`, from its UTF-8 size: O(1) for ASCII),
        # which is reserved in the session's queued input until the encoder thread has
        # tokenized it. So a text that may not fit costs no tokenizer time at all, and one
        # session's tokenizing is bounded by what the engine takes of its own input.
        max_tokens = chat.max_item_tokens(role, text)
        check_input_room(self.record, max_tokens, "text item", ErrorCode.TOO_MANY_PENDING,
                         param, upper_bound=True)
        if content_type is not None:
            self._add_item(se.ItemOut(id=item_id or p.new_id("item"), role=role,
                                      content=[se.ContentOut(type=content_type, text=text)]))
        self._queue_frame("text", lambda: Input.of_tokens(chat.item_ids(role, text)),
                          max_tokens)

    def _create_response(self, params: p.ResponseParamsIn) -> None:
        chat = self._chat()
        if self._client_response is not None:
            raise ClientError(ErrorCode.ACTIVE_RESPONSE, f"response "
                              f"{self._client_response.response_id} is still in progress")
        if params.conversation not in (None, "auto") or params.input is not None:
            raise ClientError(ErrorCode.UNSUPPORTED, "out-of-band responses are not served: "
                              "a response continues the session's one conversation (its KV)",
                              "response.conversation" if params.input is None
                              else "response.input")
        if params.instructions is not None:
            self._queue_text("system", params.instructions, "response.instructions",
                             content_type=None)
        # no frame-count check: one client response at a time bounds these frames already
        # (audio appended and committed just before, as clients do, must not refuse it)
        token_ids = chat.response_prefix_ids
        check_input_room(self.record, len(token_ids), "response", ErrorCode.TOO_MANY_PENDING)
        response = self._new_response(params.metadata)
        self._client_response = response
        self._queue_frame("response", lambda: Input.of_tokens(token_ids), len(token_ids),
                          respond=True, response=response)

    def _cancel_response(self, response_id: str | None) -> None:
        """Cancel a response under way: the client's (`response.create`, or server VAD's), or,
        by id, a duplex frame's."""
        client = self._client_response
        if client is not None and response_id in (None, client.response_id):
            self._cancel_client_response(CLIENT_CANCELLED)
            return
        for index, origin in self._origins.items():
            if origin.response is not None and origin.response.response_id == response_id:
                self.host.cancel_frame(self.engine_session_id, index, CLIENT_CANCELLED)
                return
        raise ClientError(ErrorCode.RESPONSE_NOT_ACTIVE, "no response in progress" + (
            f" with id {response_id!r}" if response_id else ""), "response_id")

    def _cancel_client_response(self, reason: str) -> None:
        if self._client_response_index is None:
            self._cancel_pending = reason  # its input is still on the encoder thread
            return
        self.host.cancel_frame(self.engine_session_id, self._client_response_index, reason)

    def _chat(self) -> ChatText:
        if self.host.chat is None:
            raise ClientError(ErrorCode.TEXT_UNSUPPORTED, "this model has no tokenizer: "
                              "text items and text responses are not available")
        return self.host.chat

    def _add_item(self, item: se.ItemOut) -> None:
        """A complete item (the client's): added and done at once."""
        previous = self.conversation.add(item)
        self.emit(se.ConversationItemAdded(previous_item_id=previous, item=item))
        self.emit(se.ConversationItemDone(previous_item_id=previous, item=item))

    # ---- turns (server VAD: `TurnTaker`) -------------------------------------------------
    def end_turn(self, item_id: str) -> None:
        if not self.appended_since_commit_bytes:
            return  # the client committed this speech already
        self._commit(item_id)
        if self.turns.settings.create_response and self.settings.mode is SessionMode.TURN:
            self._respond_to_turn()

    def _respond_to_turn(self) -> None:
        """`response.create` on the client's behalf; what would refuse it is told as an
        `error` (e.g. a response still under way with interrupt_response off)."""
        try:
            self._create_response(p.ResponseParamsIn())
        except ClientError as err:
            self.emit(p.ErrorEvent.of(err))

    def interrupt_response(self) -> None:
        """Cancel the response under way (its frame: in the beat now, or once it is)."""
        if self._client_response is not None:
            self._cancel_client_response(TURN_DETECTED)

    # ---- frames ------------------------------------------------------------------------
    def _encode_then_submit(self, cut: PcmCut) -> None:
        framer = self.framer
        self._queue_frame("audio", lambda: Input(embeddings=framer.encode(cut)),
                          framer.tokens(len(cut.pcm)),
                          respond=self.settings.mode is SessionMode.DUPLEX,
                          audio_end_ms=cut.audio_end_ms)

    def _queue_frame(self, kind: FrameKind, make_input: Callable[[], Input], num_tokens: int,
                     respond: bool = False, audio_end_ms: float | None = None,
                     response: ResponseHandle | None = None) -> None:
        """Every frame passes the encoder thread's queue (audio to be encoded there, text as
        it is), so frames reach the beat in the order the client sent them and no encoding
        runs on the loop. It is accepted in the beat's record now (its input was checked
        against the session's bound) and arrives now (audio: when its last byte did), so
        encoding time counts in its latency."""
        self.started = True
        accepted = self.host.accept(self.engine_session_id, num_tokens)
        arrival_s = self.host.now_s()
        self.host.encode(make_input).add_done_callback(lambda done: self._on_input_ready(
            done, accepted, kind, respond, audio_end_ms, response, arrival_s))

    def _on_input_ready(self, done: asyncio.Future, accepted: Accepted, kind: FrameKind,
                        respond: bool, audio_end_ms: float | None,
                        response: ResponseHandle | None, arrival_s: float) -> None:
        if self.closed or done.cancelled():
            return  # the session ended (its record with it) or the server is stopping
        if done.exception() is not None:
            log.error("session %s: preparing a frame failed", self.id,
                      exc_info=done.exception())
            self.host.withdraw(accepted)
            self.on_failure()
            return
        frame_input: Input = done.result()
        if frame_input.num_tokens == 0 and kind == "audio":
            self.host.withdraw(accepted)  # a commit with less than a token of audio left
            return
        if response is None and self.profile.output_tokens_for(respond) > 0:
            response = self._new_response()
        index = self.record.frames_submitted  # frames are numbered as they reach the beat
        assert index not in self._origins, (index, self._origins)
        self._origins[index] = FrameOrigin(kind, frame_input.num_tokens, response,
                                           audio_end_ms)
        if kind == "response":
            self._client_response_index = index
        self.host.submit(Frame(self.engine_session_id, index, arrival_s, frame_input.token_ids,
                               frame_input.embeddings, respond), accepted)  # may answer at once
        if kind == "response" and self._cancel_pending is not None:
            reason, self._cancel_pending = self._cancel_pending, None
            self.host.cancel_frame(self.engine_session_id, index, reason)

    def _new_response(self, metadata: dict[str, str] | None = None) -> ResponseHandle:
        response = ResponseHandle(p.new_id("resp"), p.new_id("item"),
                                  self.conversation.last_item_id, metadata)
        self.conversation.add(assistant_item(response, "in_progress", None))
        for event in response_opened(response):
            self.emit(event)
        return response

    def _on_result_guarded(self, result: FrameResult) -> None:
        try:
            self.on_result(result)
        except Exception:  # one session's failure must not stop the beat for the others
            log.exception("session %s failed on a frame result", self.id)
            self.on_failure()

    def on_result(self, result: FrameResult) -> None:
        origin = self._origins.pop(result.index)  # every frame is answered exactly once
        text = self._text_of(result.token_ids, flush=origin.kind == "response")
        for event in result_events(result, origin, text, self.extensions):
            if isinstance(event, se.ResponseOutputItemDone):
                self.conversation.update(event.item)
            self.emit(event)
        if origin.kind == "response":
            self._client_response = self._client_response_index = None
        self.host.settled(self)

    def _text_of(self, token_ids: list[int], flush: bool) -> str:
        if self.decoder is None:
            return ""
        text = self.decoder.push(token_ids)
        return text + self.decoder.flush() if flush else text

    # ---- checkpoints (serve.checkpoint) ---------------------------------------------------
    @property
    def quiescent(self) -> bool:
        """Nothing of it under way on the loop, encoder or beat: a checkpoint may be taken
        (the engine side is checked on the engine thread: nothing still generating)."""
        record = self.record
        return (not self.closed and not self._origins and record.unanswered_frames == 0
                and record.queued_input_tokens == 0 and self._client_response is None
                and self._cancel_pending is None and not record.ended_reason)

    # ---- descriptions --------------------------------------------------------------------
    def describe(self) -> p.SessionOut:
        return self.settings.describe(self.id, self.host.model_name, self.profile,
                                      self._policy(), self.host.config.token_rate_hz,
                                      self.instructions, self.extensions, self.resume)

    def _policy(self):
        """The KV bound in force: the profile's, or the one KV pressure imposed."""
        if self.closed:
            return self.profile.policy
        return self.record.policy

    def summary(self, now_s: float, resident_kv_tokens: int | None) -> dict:
        """What `GET /v1/sessions` shows of this session (`serve.session_view`)."""
        return summary(self, now_s, resident_kv_tokens)
