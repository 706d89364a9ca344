"""One Realtime session: client events in, frames into its `Stream`, frame results out as
events.

Owns what the client's events do to the session (items, commits, responses) and the
session's `Stream` (`metronome.stream`: the one record of its input and frames, which the
beat and the engine advance). A frame is accepted in the stream at once (`Beat.accept`: the
stream counts it and its input from then on, and the limits of `serve.edge.input_limits`
read the stream, never a count of their own), its input is made on the encoder thread, then
submitted; the response it belongs to travels on the frame (`Frame.tag`) and its result
comes back as the same frame, rendered into events (`serve.responses`). Its settings are
`serve.settings`, its audio framing `serve.audio_input`, its server VAD
`serve.turn_detection`. No socket here: client messages come in through `receive` (text,
within the size limit), events go out through `emit`, and a `ClientError` goes to
`on_error` (answered with an `error`, the session unchanged). The server (`serve.serving`)
provides the beat, the clock and the worker threads: audio is cut into frames on the loop
and encoded off it; text is tokenized there, its room checked first against the most
tokens it can make.

Hearing and speaking: a turn session's audio frames are heard by Whisper on the encoder
thread (`serve.hearing`: their input is the words they commit) unless the server takes the
embedding front end; a response whose session speaks is spoken as its tokens come
(`serve.speaking`, on the voice thread) and closes once the voice is done.

Responses: a frame whose profile asks for output is one response (opened when its input is
ready, closed when the beat answers it). In duplex mode that is every frame, so text streams
back per frame with no commit; in turn mode audio frames only prefill (no response) and a
reply is the frame that `response.create` submits. Mode and input rate are fixed once input
has started: the stream's profile is. With server VAD, a turn's end commits the buffer and,
in turn mode with `create_response`, creates a response, as the client's events would.
`response.cancel` cancels a response's frame in the beat (`client_cancelled`); items only
join the conversation at its end (`serve.conversation`); what the GA API has and the server
cannot do (deleting an item already in the KV, the output audio buffer) is refused by
name (`UNSUPPORTED_EVENT_TYPES`); `conversation.item.truncate` rewinds the latest reply's
unheard tokens out of the KV (`serve.rewind`). `metronome.*` events go only to a client that
opted in (`extensions`).

Every event the session emits goes through its `EventChannel` (`resume.event_log`):
numbered and kept, then to the connection, so a client that drops and resumes gets what it
missed. What resuming keeps of a session is on it: its grant (token and lease), its
checkpointing, a take-over's replay, the client events it applied (`client_seq`) and its
saved state (`saved`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Protocol, TypeVar

import torch

from metronome.audio.frontend import AudioFrontEnd
from metronome.audio.silero import SileroVad
from metronome.engine.types import Rebound
from metronome.runtime.beat import Beat
from metronome.runtime.profile import SessionMode
from metronome.serve import protocol as p
from metronome.serve import truncation
from metronome.serve.audio_input import AudioFramer, decode_pcm16
from metronome.serve.config import ServerConfig
from metronome.serve.conversation import Conversation
from metronome.serve.edge.input_limits import (
    check_audio_room,
    check_input_room,
    check_room_for_a_frame,
    check_text_length,
)
from metronome.serve.hearing import Heard, Hearing
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol import server as se
from metronome.serve.protocol.schema import ResumeOut
from metronome.serve.responses import (
    CLIENT_CANCELLED,
    TURN_DETECTED,
    Response,
    assistant_item,
    response_opened,
    result_events,
    spoken_close_events,
)
from metronome.serve.resume.event_log import EventChannel, EventLog, Sink
from metronome.serve.resume.lease import Grant
from metronome.serve.resume.takeover import CheckpointState, LoggedEvents
from metronome.serve.rewind import Reply, truncate
from metronome.serve.settings import OUTPUT_RATE_HZ, SessionSettings
from metronome.serve.speaking import Speech
from metronome.serve.text import ChatText
from metronome.serve.turn_detection import TurnDetection
from metronome.stream import Frame, FrameStatus, Stream

HELD_REASON = "client dropped: held for a resume"  # frames its lease answered `cancelled`

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_BYTES_PER_TOKEN = 16  # instructions longer than this many bytes per pinned token allowed
# cannot be pinned in any real text: refused before they are tokenized


class Host(Protocol):
    """What a session uses of its server (`serve.serving.Serving`)."""

    config: ServerConfig
    model_name: str
    chat: ChatText | None  # None: the model has no tokenizer (presets): audio only
    beat: Beat  # the session's stream is in it
    resume: ResumeHooks
    accepts_audio: bool  # the engine takes the audio front end's embeddings
    bound_limits: truncation.BoundLimits  # what a session's bound may be

    def now_s(self) -> float: ...

    def frontend(self, sample_rate_hz: int) -> AudioFrontEnd: ...

    def on_engine(self, work: Callable[[], T]) -> asyncio.Future[T]:
        """Run `work` on the engine thread between steps, in order with the beat's commands."""

    def encode(self, work: Callable[[], T]) -> asyncio.Future[T]:
        """Run `work` on the encoder thread; futures resolve on the loop in call order."""

    def detect(self, work: Callable[[SileroVad], T]) -> asyncio.Future[T]:
        """Run server VAD `work` on the VAD thread, in call order."""


class ResumeHooks(Protocol):
    """What resuming hears of a session (`serve.resume.resumer.Resumer`)."""

    def applied(self, session: RealtimeSession, event_text: str) -> None: ...

    def settled(self, session: RealtimeSession) -> None: ...

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
    def __init__(self, serving: Host, sink: Sink, on_failure: Callable[[], None],
                 on_error: Callable[[ClientError], None], extensions: bool = False,
                 saved: dict | None = None, stream: Stream | None = None) -> None:
        """A new session; or, with `saved` (`saved()`, from a checkpoint), the one it
        describes, continuing `stream`, which the server restored in its engine."""
        self.id = p.new_id("sess") if saved is None else saved["id"]
        self.serving = serving
        config = serving.config
        # Its events, numbered and kept for a resume, to its client's connection; a bug in
        # this session (`on_failure`): the connection ends it (1011), or its lease ends.
        self.channel = EventChannel(EventLog(config.max_outbox_events, config.max_outbox_bytes),
                                    sink, on_failure)
        self.emit = self.channel.emit
        self.on_failure = self.channel.fail
        self.on_error = on_error  # a client event refused: the connection's `error` event
        self.extensions = extensions  # the client opted in to `metronome.*` events
        self.settings = SessionSettings.defaults(config, serving.speaks) if saved is None else (
            SessionSettings.load(saved["settings"]))
        self.opened_at_s = serving.now_s() - (0.0 if saved is None else saved["age_s"])
        # ---- what resuming keeps of it (`serve.resume`) -------------------------------------
        self.connection = None  # its client's connection; None while it is leased
        self.resume: ResumeOut | None = None  # how its client resumes it (shown to it)
        self.grant: Grant | None = None  # its token and lease
        self.checkpointing = CheckpointState()
        self.replay: LoggedEvents | None = None  # a take-over's client events still to apply
        self.client_seq = 0  # client events applied (a checkpoint's log numbers them)
        self.last_client_event_id: str | None = None  # the last one's
        # ---- its stream ----------------------------------------------------------------------
        if saved is None:
            self.stream = self.new_stream()
            serving.beat.add(self.stream)
        else:
            assert stream is not None and stream.id == self.id
            self.stream = stream
            stream.on_result, stream.on_rebound = self._on_result_guarded, self._on_rebound
            stream.on_tokens = self._on_tokens_guarded
            serving.beat.adopt(stream)
        self.framer = AudioFramer(serving.frontend(self.settings.sample_rate_hz),
                                  config.frame_period_s)
        self.decoder = serving.chat.decoder() if serving.chat else None
        self.started = False  # input has reached the stream: mode and rate are fixed
        self.closed = False
        self.appended_since_commit_bytes = 0
        self.committed_ms = 0.0  # input stream position of the last commit
        self.conversation = Conversation()
        self._client_response: Response | None = None  # `response.create`'s, one at a time
        self._client_response_frame: Frame | None = None  # the frame that answers it
        self.told_not_honored: set[str] = set()  # logged once per session
        self.instructions: str | None = None
        self.bound = truncation.SessionBound()  # its session.truncation and pinned prefix
        self.last_reply: Reply | None = None  # what a conversation.item.truncate may cut
        self.turns: TurnDetection | None = None  # server VAD; None: the client commits
        self.hearing = self._new_hearing()  # Whisper hears a turn session's audio
        self.speech: Speech | None = None  # the response being spoken
        if saved is not None:
            self._load(saved)
        else:
            self.set_turns(self.settings.turns)

    def new_stream(self, settings: SessionSettings | None = None) -> Stream:
        """This session's stream for its settings (or `settings`), opened now."""
        mode = (settings or self.settings).mode
        return Stream(self.id, self.serving.config.profile(mode), self.serving.now_s(),
                      on_result=self._on_result_guarded, on_rebound=self._on_rebound,
                      on_tokens=self._on_tokens_guarded)

    def _new_hearing(self) -> Hearing | None:
        """Whisper's ears for a turn session on a server that hears (duplex sessions take
        the embedding front end: one KV entry per audio token, as an omni encoder)."""
        serving = self.serving
        if serving.whisper is None or self.settings.mode is not SessionMode.TURN:
            return None
        return Hearing(serving.whisper, serving.chat, self.settings.sample_rate_hz)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self.emit(se.SessionCreated(session=self.describe()))

    def close(self) -> None:
        """Answer what is owed (`cancelled`) and give the stream's blocks back now; audio
        still being encoded is dropped when it comes back."""
        self.closed = True
        if self.turns is not None:
            self.turns.stop()
        if self.speech is not None:
            self.speech.cancel()
        self.serving.beat.close(self.stream, self.serving.now_s())

    def stop_generating(self) -> None:
        """Its client dropped and it is held for a resume: every frame it owes (the reply
        under way, spoken or not, and its queued input's frames) is answered `cancelled`
        where it got to, its events kept for the resume, and its input waits in the stream,
        unfed, until `resume_generating` (`Beat.hold`): a dropped client keeps no engine or
        voice busy for the grace, and loses no input."""
        speech = self.speech
        if speech is not None and speech.finishing:
            speech.cancel(CLIENT_CANCELLED)
        self.serving.beat.hold(self.stream, self.serving.now_s(), HELD_REASON)

    def resume_generating(self) -> None:
        """Its client is back: its input is fed again."""
        self.serving.beat.release(self.stream, self.serving.now_s())

    def _on_rebound(self, rebound: Rebound) -> None:
        """The engine changed this session's bound (KV pressure, the position limit, a re-pin):
        tell a client that opted in."""
        if rebound.reason == "pinned":  # re-pinned: scored at rolling positions from now on
            self._set_bound(truncation.pinned(self.bound, rebound.policy.sink_tokens,
                                              self.serving.bound_limits))
        elif rebound.reason == "position_limit":  # a later choice keeps rolling positions
            self.bound = replace(self.bound, rolled=True)
        if self.extensions:
            self.emit(se.MetronomeSessionBounded(session_id=self.id, bound=se.BoundOut(
                policy=str(rebound.policy), reason=rebound.reason,
                freed_blocks=rebound.freed_blocks,
                resident_kv_tokens=rebound.resident_tokens)))

    # ---- client messages ---------------------------------------------------------------
    def receive(self, text: str) -> None:
        """A client message (JSON text within the size limit): applied, or queued behind the
        client events a take-over still replays (the client sent it after all of them)."""
        if self.replay is not None and self.replay.pending:
            self.replay.offer(text)
            return
        self.apply(text, logged=False)

    def apply(self, text: str, logged: bool) -> None:
        """Apply one client event; `logged`: replayed from the store's log (numbered and
        logged already), else logged now if it applies. A refusal goes to `on_error`."""
        try:
            event = p.parse_client_event(text, self.serving.config.max_message_values,
                                         self.serving.config.max_message_depth)
        except ClientError as err:
            self.on_error(err)
            return
        if logged:  # counted where it was first applied, whatever happens to it here
            self._count_client_event(event)
        try:
            self.handle(event)
        except ClientError as err:
            err.event_id = event.event_id
            self.on_error(err)
            return
        if not logged:
            self._count_client_event(event)
            self.serving.resume.applied(self, text)

    def _count_client_event(self, event: p.ClientEvent) -> None:
        self.client_seq += 1
        self.last_client_event_id = event.event_id

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
            case p.ConversationItemTruncate():
                truncate(self, event, self._chat().tokenizer.decode)
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
        config = self.serving.config
        serving = self.serving
        settings = self.settings.updated(update, config, serving.chat is not None,
                                         serving.speaks, serving.hears)
        instructions = update.instructions
        new_instructions = instructions is not None and instructions != self.instructions
        # refused before anything changes: the text, the bound chosen, the instructions' pin
        limits = serving.bound_limits
        bound = self.bound
        if "truncation" in update.model_fields_set and update.truncation is not None:
            bound = truncation.choose(update.truncation, bound, limits, self.started)
        instruction_ids = None
        if new_instructions:
            check_text_length(instructions, config.max_text_chars, "session.instructions")
            if serving.chat is not None:
                instruction_ids = self._instruction_ids(instructions, limits)
                if not self.started and limits.per_session:  # its first input: pinned
                    bound = truncation.pinned(bound, len(instruction_ids), limits)
        current = self.settings
        if (settings.mode, settings.sample_rate_hz) != (current.mode, current.sample_rate_hz):
            self._reconfigure(settings)
        self._set_bound(bound)
        not_honored = update.not_honored(serving.speaks, serving.hears)
        if new_instructions:
            if instruction_ids is None:
                not_honored.append("instructions (the model has no tokenizer)")
            else:
                self._instruct(instructions, instruction_ids)
        self.settings = settings
        self.set_turns(settings.turns)
        self._tell_not_honored(not_honored)
        self.emit(se.SessionUpdated(session=self.describe()))

    def _instruction_ids(self, instructions: str, limits: truncation.BoundLimits) -> list[int]:
        """The instructions' tokens as a system message, within the pinned-prefix ceiling.
        Tokenized on the loop (instructions change rarely; ~0.3 us a byte) only when they can
        be that short: a text of more than `MAX_BYTES_PER_TOKEN` bytes a token allowed is
        refused unread."""
        chat = self.serving.chat
        upper = chat.max_item_tokens("system", instructions)
        if upper > limits.max_pinned_tokens * MAX_BYTES_PER_TOKEN:
            truncation.check_instructions(upper // MAX_BYTES_PER_TOKEN, limits)
        ids = chat.item_ids("system", instructions)
        if limits.per_session:
            truncation.check_instructions(len(ids), limits)
        return ids

    def _set_bound(self, bound: truncation.SessionBound) -> None:
        """Serve the session under `bound` from now on (the engine applies it in order, before
        any input queued after this)."""
        limits = self.serving.bound_limits
        policy = bound.policy(limits)
        self.bound = bound
        if limits.per_session and policy != self.stream.policy:
            self.serving.beat.set_policy(self.stream, policy)

    def _instruct(self, instructions: str, ids: list[int]) -> None:
        """Instructions are a system message at this point of the conversation; pinned when
        they are its first input (`_update` set the bound), else re-pinned: the engine
        rewrites the pinned prefix with them once the window has left the old one
        (`Engine.repin`, told back as a `pinned` rebound)."""
        started = self.started
        self._queue_ids("system", ids, "session.instructions")
        self.instructions = instructions
        if started and self.serving.bound_limits.per_session and self.stream.policy.bounded:
            sid = self.id
            engine = self.serving.beat.engine
            self.serving.on_engine(lambda: engine.repin(sid, ids)).add_done_callback(
                lambda done: done.cancelled() or done.exception() is None or log.error(
                    "session %s: re-pinning its instructions failed: %s", sid,
                    done.exception()))

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
            turns, self.serving, rate_hz, self.framer.received_ms, self, self.on_failure)

    def _reconfigure(self, settings: SessionSettings) -> None:
        if self.started or self.framer.received_bytes:
            raise ClientError(ErrorCode.SESSION_LOCKED,
                              "mode and input format are fixed once input has started",
                              "session")
        serving = self.serving
        if settings.mode is not self.settings.mode:  # nothing submitted: a fresh stream
            serving.beat.close(self.stream, serving.now_s())
            self.stream = self.new_stream(settings)
            serving.beat.add(self.stream)
        self.framer = AudioFramer(serving.frontend(settings.sample_rate_hz),
                                  serving.config.frame_period_s)
        self.settings = settings
        self.hearing = self._new_hearing()

    def _append(self, audio_b64: str) -> None:
        if not self.serving.accepts_audio and self.hearing is None:
            raise ClientError(ErrorCode.AUDIO_UNSUPPORTED, "this server's engine takes text "
                              "only (vLLM's streaming input refuses embeddings): send text "
                              "items with conversation.item.create", "audio")
        # what it decodes to, at least: a chunk that cannot fit is refused before decoding
        # (~3 ms of loop time per MiB)
        framer, config = self.framer, self.serving.config
        check_audio_room(self.stream, framer, config, max(0, len(audio_b64) // 4 * 3 - 2))
        pcm = decode_pcm16(audio_b64)
        check_audio_room(self.stream, framer, config, len(pcm))
        self.appended_since_commit_bytes += len(pcm)
        for chunk, audio_end_ms in framer.cut(pcm):
            self._encode_then_submit(chunk, audio_end_ms, final=False,
                                     turn_bytes=self.appended_since_commit_bytes)
        if self.turns is not None:
            self.turns.push(pcm)

    def _commit(self, item_id: str | None = None) -> None:
        """The buffer becomes a user item: `item_id` (a turn's), the speech under way's, or a
        new one."""
        if not self.appended_since_commit_bytes:
            raise ClientError(ErrorCode.COMMIT_EMPTY, "no audio appended since the last commit")
        turn_bytes, self.appended_since_commit_bytes = self.appended_since_commit_bytes, 0
        self._encode_then_submit(*self.framer.cut_rest(), final=True, turn_bytes=turn_bytes)
        self.committed_ms = self.framer.received_ms
        # a commit mid-speech takes the turn's item id with it
        turn_item_id = self.turns.take_item_id() if self.turns is not None else None
        item_id = item_id or turn_item_id or p.new_id("item")
        item = se.ItemOut(id=item_id, role="user",
                          content=[se.ContentOut(type="input_audio")])
        self.emit(se.InputAudioBufferCommitted(item_id=item.id,
                                               previous_item_id=self.conversation.last_item_id))
        self._add_item(item)
        if self.hearing is not None:
            # the next turn's speech is still to come
            self.hearing.speech_from_ms = self.hearing.speech_end_ms = None
            audio_s = turn_bytes / (2 * self.settings.sample_rate_hz)
            self._transcribed(item_id, self.hearing.committed(item_id, audio_s), None)

    def _clear_buffer(self) -> None:
        """Audio appended and not yet cut into a frame is dropped; frames already in the
        stream are the conversation's (a KV is written in order)."""
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
        config = self.serving.config
        check_text_length(text, config.max_text_chars, param)
        check_room_for_a_frame(self.stream, config.frame_period_s, config.max_buffered_audio_s)
        # Nothing is tokenized on the loop: the room is checked against the most tokens the
        # text can make (`ChatText.max_item_tokens`, from its UTF-8 size: O(1) for ASCII),
        # which is reserved in the stream's queued input until the encoder thread has
        # tokenized it. So a text that may not fit costs no tokenizer time at all, and one
        # session's tokenizing is bounded by what the engine takes of its own input.
        max_tokens = chat.max_item_tokens(role, text)
        check_input_room(self.stream, max_tokens, "text item", ErrorCode.TOO_MANY_PENDING,
                         param, upper_bound=True)
        if content_type is not None:
            self._add_item(se.ItemOut(id=item_id or p.new_id("item"), role=role,
                                      content=[se.ContentOut(type=content_type, text=text)]))
        self._queue_frame("text", lambda: _ids(chat.item_ids(role, text)), max_tokens)

    def _queue_ids(self, role: str, ids: list[int], param: str) -> None:
        """A message tokenized already (instructions) into the model's context: a frame."""
        config = self.serving.config
        check_room_for_a_frame(self.stream, config.frame_period_s, config.max_buffered_audio_s)
        check_input_room(self.stream, len(ids), f"{role} message", ErrorCode.TOO_MANY_PENDING,
                         param)
        self._queue_frame("text", lambda: _ids(ids), len(ids))

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
        check_input_room(self.stream, len(token_ids), "response", ErrorCode.TOO_MANY_PENDING)
        spoken = self.settings.speak and self.serving.voice is not None
        response = self._new_response(params.metadata, spoken)
        if spoken:
            self.speech = Speech(response, self.serving.voice, OUTPUT_RATE_HZ,
                                 self.serving.speak, self.emit,
                                 self.serving.stage_seconds.labels("voice").observe)
        self._client_response = response
        self._client_response_frame = self._queue_frame(
            "response", lambda: _ids(token_ids), len(token_ids), respond=True,
            response=response)

    def _cancel_response(self, response_id: str | None) -> None:
        """Cancel a response under way: the client's (`response.create`, or server VAD's), or,
        by id, a duplex frame's."""
        client = self._client_response
        if client is not None and response_id in (None, client.response_id):
            self._cancel_client_response(CLIENT_CANCELLED)
            return
        for frame in self.stream.frames:
            if frame.tag is not None and frame.tag.response_id == response_id:
                self.serving.beat.cancel(frame, self.serving.now_s(), CLIENT_CANCELLED)
                return
        raise ClientError(ErrorCode.RESPONSE_NOT_ACTIVE, "no response in progress" + (
            f" with id {response_id!r}" if response_id else ""), "response_id")

    def _cancel_client_response(self, reason: str) -> None:
        """In the beat now, or, its input still on the encoder thread, once it arrives; a
        reply being spoken after its frame was answered stops at once."""
        speech = self.speech
        if speech is not None and speech.finishing:
            speech.cancel(reason)
            return
        self.serving.beat.cancel(self._client_response_frame, self.serving.now_s(), reason)

    def _chat(self) -> ChatText:
        if self.serving.chat is None:
            raise ClientError(ErrorCode.TEXT_UNSUPPORTED, "this model has no tokenizer: "
                              "text items and text responses are not available")
        return self.serving.chat

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

    def speech_started(self, start_ms: float) -> None:
        """Server VAD heard speech start at `start_ms` (its prefix padding included): the
        turn Whisper hears starts there."""
        if self.hearing is not None:
            self.hearing.speech_from_ms = start_ms

    def speech_stopped(self, end_ms: float) -> None:
        """Server VAD heard the speech end at `end_ms` (before the silence that confirmed it)."""
        if self.hearing is not None:
            self.hearing.speech_end_ms = end_ms

    def interrupt_response(self) -> None:
        """Cancel the response under way (its frame: in the beat now, or once it is)."""
        if self._client_response is not None:
            self._cancel_client_response(TURN_DETECTED)

    # ---- frames ------------------------------------------------------------------------
    def _encode_then_submit(self, pcm: bytes, audio_end_ms: float, final: bool,
                            turn_bytes: int = 0) -> None:
        if self.hearing is not None:
            self._hear_then_submit(pcm, audio_end_ms, final, turn_bytes)
            return
        framer = self.framer
        self._queue_frame("audio", lambda: framer.encode(pcm, final), framer.tokens(len(pcm)),
                          respond=self.settings.mode is SessionMode.DUPLEX,
                          audio_end_ms=audio_end_ms)

    def _hear_then_submit(self, pcm: bytes, audio_end_ms: float, final: bool,
                          turn_bytes: int) -> None:
        """A turn's audio frame, heard by Whisper on the encoder thread (`serve.hearing`):
        its input is the words it commits. It reserves the most tokens the turn's audio
        not yet heard to the end can make."""
        hearing = self.hearing
        hearing.latest_cut_ms = audio_end_ms
        speech_from_ms = hearing.speech_from_ms if self.turns is not None else self.committed_ms
        heard = Heard()
        stage = self.serving.stage_seconds.labels("encoder")
        queued_at_s = time.monotonic()
        speech_end_ms = hearing.speech_end_ms if final else None

        def hear() -> torch.Tensor:
            start = time.perf_counter()
            ids = hearing.hear(pcm, final, audio_end_ms, speech_from_ms, heard, queued_at_s,
                               speech_end_ms)
            if heard.passed:
                stage.observe(time.perf_counter() - start)
            return _ids(ids)

        def on_ready() -> None:
            self._transcribed(*hearing.heard_words(heard))

        self._queue_frame("audio", hear, Hearing.max_tokens(turn_bytes, hearing.sample_rate_hz),
                          audio_end_ms=audio_end_ms, on_ready=on_ready)

    def _transcribed(self, item_id: str | None, delta: str, transcript: str | None) -> None:
        """The user's words as they are heard: transcription events for a client that asked,
        and the item's transcript once the turn is heard to the end."""
        if item_id is None:
            return
        asked = self.settings.transcription is not None
        if delta and asked:
            self.emit(se.InputAudioTranscriptionDelta(item_id=item_id, delta=delta))
        if transcript is not None:
            if asked:
                self.emit(se.InputAudioTranscriptionCompleted(
                    item_id=item_id, transcript=transcript,
                    usage=se.DurationUsage(seconds=round(self.hearing.turn_audio_s, 3))))
            self.conversation.set_transcript(item_id, transcript)

    def _queue_frame(self, kind: str, make_input: Callable[[], torch.Tensor],
                     num_tokens: int, respond: bool = False,
                     audio_end_ms: float | None = None,
                     response: Response | None = None,
                     on_ready: Callable[[], None] | None = None) -> Frame:
        """Every frame passes the encoder thread's queue (audio to be encoded there, text as
        it is), so frames reach the stream in the order the client sent them and no encoding
        runs on the loop. It is accepted in the stream now (its input was checked against
        the session's bound) and arrives now (audio: when its last byte did), so encoding
        time counts in its latency."""
        self.started = True
        frame = Frame(self.id, self.serving.now_s(), respond, kind, response, audio_end_ms,
                      input_tokens=num_tokens)
        self.serving.beat.accept(self.stream, frame)
        self.serving.encode(make_input).add_done_callback(
            lambda done: self._on_input_ready(done, frame, on_ready))
        return frame

    def _on_input_ready(self, done: asyncio.Future, frame: Frame,
                        on_ready: Callable[[], None] | None = None) -> None:
        if self.closed or done.cancelled():
            return  # the session ended (its stream with it) or the server is stopping
        if on_ready is not None and done.exception() is None:
            on_ready()
        beat = self.serving.beat
        if done.exception() is not None:
            log.error("session %s: preparing a frame failed", self.id,
                      exc_info=done.exception())
            beat.withdraw(frame)
            self.on_failure()
            return
        data: torch.Tensor = done.result()
        if frame.kind == "audio" and len(data) == 0:
            beat.withdraw(frame)  # a commit with less than a token of audio left
            return
        if frame.tag is None and frame.expects_output:
            frame.tag = self._new_response()
        audio = data.is_floating_point()
        beat.submit(frame, self.serving.now_s(), token_ids=None if audio else data,
                    embeddings=data if audio else None)  # may answer it at once

    def _new_response(self, metadata: dict[str, str] | None = None,
                      spoken: bool = False) -> Response:
        response = Response(p.new_id("resp"), p.new_id("item"),
                            self.conversation.last_item_id, metadata)
        self.conversation.add(assistant_item(response, "in_progress", None))
        for event in response_opened(response, spoken):
            self.emit(event)
        return response

    def _on_result_guarded(self, frame: Frame) -> None:
        try:
            self.on_result(frame)
        except Exception:  # one session's failure must not stop the beat for the others
            log.exception("session %s failed on a frame result", self.id)
            self.on_failure()

    def _on_tokens_guarded(self, frame: Frame, token_ids: list[int]) -> None:
        try:
            self._on_tokens(frame, token_ids)
        except Exception:  # as for results: one session's failure must not stop the beat
            log.exception("session %s failed on a step's tokens", self.id)
            self.on_failure()

    def _on_tokens(self, frame: Frame, token_ids: list[int]) -> None:
        """A step's tokens of the frame in flight: a reply being spoken hears them now."""
        speech = self.speech
        if speech is not None and frame.tag is speech.response and self.decoder is not None:
            speech.push(self.decoder.push(token_ids))

    def on_result(self, frame: Frame) -> None:
        speech = self.speech
        if speech is not None and frame.tag is speech.response:
            self._on_spoken_result(frame, speech)
            return
        text = self._text_of(frame.token_ids, flush=frame.kind == "response")
        self._close(frame, result_events(frame, text, self.extensions))

    def _close(self, frame: Frame, events: list[p.ServerEvent]) -> None:
        """A frame's closing events out (its item's final form kept in the conversation);
        the client's response, if it was this frame's, is over."""
        for event in events:
            if isinstance(event, se.ResponseOutputItemDone):
                self.conversation.update(event.item)
            self.emit(event)
        if frame.tag is not None:
            speech = self.speech if self.speech is not None and self.speech.response is \
                frame.tag else None
            self.last_reply = Reply(frame.tag.item_id, list(frame.token_ids),
                                    [] if speech is None else list(speech.said))
        if frame is self._client_response_frame:
            self._client_response = self._client_response_frame = None
        self.serving.resume.settled(self)

    def _on_spoken_result(self, frame: Frame, speech: Speech) -> None:
        """The reply's frame is answered: its text is all written (its tokens went to the
        voice step by step); it closes once the voice has said the rest."""
        if frame.start_s is not None:
            self.serving.stage_seconds.labels("lm").observe(frame.finish_s - frame.start_s)
        speech.push(self.decoder.flush())
        for event in result_events(frame, "", self.extensions, spoken=True):
            self.emit(event)
        if frame.status is FrameStatus.CANCELLED:
            speech.cancel(frame.reason)
        speech.finish(lambda: self._close_speech(frame, speech))

    def _close_speech(self, frame: Frame, speech: Speech) -> None:
        self._close(frame, spoken_close_events(frame, speech.spoken, speech.cancel_reason))
        if self.speech is speech:
            self.speech = None

    def _text_of(self, token_ids: list[int], flush: bool) -> str:
        if self.decoder is None:
            return ""
        text = self.decoder.push(token_ids)
        return text + self.decoder.flush() if flush else text

    # ---- checkpoints (serve.resume) -------------------------------------------------------
    @property
    def quiescent(self) -> bool:
        """Nothing of it under way on the loop, encoder or beat: a checkpoint may be taken
        (the engine side is checked on the engine thread: nothing still generating)."""
        stream = self.stream
        return (not self.closed and not stream.frames and stream.queued_input_tokens == 0
                and self._client_response is None and not stream.ended_reason
                and (self.hearing is None or not self.appended_since_commit_bytes))

    def saved(self) -> dict:
        """Everything a server needs, beside the engine's snapshot of its stream, to go on
        with this session another server held: its settings, conversation items, frame
        numbering (and KV bound, if pressure imposed one), event numbering, audio framing
        and the encoder's stream context, the text decoder's held tokens, instructions.
        Taken only while quiescent, so nothing in flight is lost by leaving it out. Server
        VAD is not carried: it listens afresh from the restored position."""
        assert self.quiescent
        stream = self.stream
        return {
            "id": self.id, "extensions": self.extensions, "settings": self.settings.saved(),
            "age_s": self.serving.now_s() - self.opened_at_s, "started": self.started,
            "frames_submitted": stream.frames_submitted,
            "bound": None if stream.bound is None else str(stream.bound),
            "next_event_seq": self.channel.log.next_seq,
            "conversation": self.conversation.saved(), "framer": self.framer.saved(),
            "committed_ms": self.committed_ms,
            "appended_since_commit_bytes": self.appended_since_commit_bytes,
            "decoder_held_ids": [] if self.decoder is None else self.decoder.held_ids,
            "instructions": self.instructions, "bound_choice": self.bound.saved(),
            "last_reply": None if self.last_reply is None else asdict(self.last_reply),
            "told_not_honored": sorted(self.told_not_honored),
            "last_client_event_id": self.last_client_event_id,
        }

    def _load(self, saved: dict) -> None:
        """`saved()`'s state onto this session, just built (its id, settings and stream
        set: the stream's frame numbering and bound are the restorer's)."""
        self.started = saved["started"]
        self.channel.log.next_seq = saved["next_event_seq"]
        self.conversation = Conversation.load(saved["conversation"])
        self.framer.load(saved["framer"])
        self.committed_ms = saved["committed_ms"]
        self.appended_since_commit_bytes = saved["appended_since_commit_bytes"]
        if self.decoder is not None:
            self.decoder.hold(saved["decoder_held_ids"])
        self.instructions = saved["instructions"]
        self.bound = truncation.SessionBound.load(saved.get("bound_choice"))  # older: auto
        reply = saved.get("last_reply")
        self.last_reply = None if reply is None else Reply(
            reply["item_id"], reply["token_ids"], [tuple(said) for said in reply["said"]])
        self.told_not_honored = set(saved["told_not_honored"])
        self.last_client_event_id = saved.get("last_client_event_id")  # older checkpoints
        self.set_turns(self.settings.turns)  # server VAD listens afresh from here

    # ---- descriptions --------------------------------------------------------------------
    def describe(self) -> p.SessionOut:
        return self.settings.describe(self.id, self.serving.model_name, self.stream.profile,
                                      self.stream.policy, self.serving.config.token_rate_hz,
                                      self.instructions, self.extensions, self.resume,
                                      self.bound.describe(self.serving.bound_limits))

    def summary(self, now_s: float) -> dict:
        """What `GET /v1/sessions` shows of this session (the server adds its connection)."""
        stream = self.stream
        last = stream.last_status
        return {
            "id": self.id, "status": "ended" if stream.ended_reason else "active",
            "ended_reason": stream.ended_reason or None, "mode": self.settings.mode.value,
            "policy": str(stream.policy), "sample_rate_hz": self.settings.sample_rate_hz,
            "age_s": round(now_s - self.opened_at_s, 3),
            "resident_kv_tokens": stream.resident_tokens,
            "frames_submitted": stream.frames_submitted,
            "frames_answered": stream.frames_answered,
            "last_frame_status": None if last is None else last.value,
            "unanswered_frames": stream.unanswered_frames,
            "queued_input_tokens": stream.queued_input_tokens,
        }


def _ids(token_ids: list[int]) -> torch.Tensor:
    """Token ids as an int64 tensor, made on the encoder thread: the loop's check of a frame
    (`check_token_ids`) is then a min and a max, not a conversion of each id (~0.3-0.9 ms on
    the loop for a 4,000-character text's ~2,600 ids)."""
    return torch.tensor(token_ids, dtype=torch.int64)
