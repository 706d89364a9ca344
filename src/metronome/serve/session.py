"""One Realtime session: client events in, frames to the beat, frame results out as events.

Owns what the client's events do to the session (items, commits, responses, the limits on
its input) and its frames on the server side: each is accepted in the beat's session record
(`Beat.accept`: the record counts it and its input from then on, and the limits here read
the record, never a count of their own), its input made on the encoder thread, then
submitted; what it belongs to (its `FrameOrigin`) is kept here by frame index until its
result comes back and is rendered into events (`serve.events`). Its settings are
`serve.settings`, its audio framing `serve.audio_input`, its server VAD
`serve.turn_detection`. No socket here: events come in through `handle` (already parsed),
go out through `emit`, and `ClientError` means "answer with an error, the session is
unchanged". The host (`serve.state`) provides the beat, the clock and the audio encoder
thread: audio is cut into frames on the loop and encoded there, off the loop.

Responses: a frame whose profile asks for output is one response
(`response.created` at submit, then `response.output_text.delta`, `metronome.frame`,
`response.done` when the beat answers it). In duplex mode that is every frame, so text
streams back per frame with no commit; in turn mode audio frames only prefill (they get a
`metronome.frame`, no response) and a reply is the frame that `response.create` submits.
Mode and input rate are fixed once input has started: the engine session's profile is.
With server VAD, a turn's end commits the buffer and, in turn mode with
`create_response`, creates a response, as the client's events would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from metronome.audio.frontend import AudioFrontEnd
from metronome.engine.types import Rebound
from metronome.runtime.frame import Frame, FrameResult, count_input_tokens
from metronome.runtime.profile import SessionMode, SessionProfile
from metronome.runtime.record import Accepted, SessionRecord
from metronome.serve import protocol as p
from metronome.serve.audio_input import AudioFramer, PcmCut, decode_pcm16
from metronome.serve.config import ServerConfig
from metronome.serve.events import (
    TURN_DETECTED,
    FrameKind,
    FrameOrigin,
    response_created,
    result_events,
)
from metronome.serve.kv_events import BoundOut, MetronomeSessionBounded
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.settings import SessionSettings
from metronome.serve.text import ChatText
from metronome.serve.turn_detection import TurnDetection, VadHost

log = logging.getLogger(__name__)


class SessionHost(VadHost, Protocol):
    config: ServerConfig
    model_name: str
    chat: ChatText | None  # None: the model has no tokenizer (presets): audio only

    def frontend(self, sample_rate_hz: int) -> AudioFrontEnd: ...

    @property
    def accepts_audio(self) -> bool: ...

    def encode(self, work: Callable[[], Input]) -> asyncio.Future[Input]:
        """Run `work` on the audio encoder thread, in call order."""

    def open_session(self, profile: SessionProfile, public_id: str,
                     on_result: Callable[[FrameResult], None],
                     on_rebound: Callable[[Rebound], None]) -> int: ...

    def record(self, engine_session_id: int) -> SessionRecord: ...

    def close_session(self, engine_session_id: int) -> None: ...

    def accept(self, engine_session_id: int, num_tokens: int) -> Accepted: ...

    def withdraw(self, accepted: Accepted) -> None: ...

    def submit(self, frame: Frame, accepted: Accepted) -> None: ...

    def cancel_frame(self, engine_session_id: int, index: int, reason: str) -> bool: ...

    def now_s(self) -> float: ...


@dataclass(frozen=True)
class Input:
    """One frame's input, made on the encoder thread: token ids or embeddings."""

    token_ids: list[int] | None = None
    embeddings: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return count_input_tokens(self.token_ids, self.embeddings)


class RealtimeSession:
    def __init__(self, host: SessionHost, emit: Callable[[p.ServerEvent], None],
                 on_failure: Callable[[], None]) -> None:
        self.id = p.new_id("sess")
        self.host = host
        self.emit = emit
        self.on_failure = on_failure  # a bug in this session: its connection ends it (1011)
        config = host.config
        self.settings = SessionSettings.defaults(config)
        self.profile = config.profile(self.settings.mode)
        self.opened_at_s = host.now_s()
        self.engine_session_id = self._open_engine_session()
        self.framer = AudioFramer(host.frontend(self.settings.sample_rate_hz),
                                  config.frame_period_s)
        self.decoder = host.chat.decoder() if host.chat else None
        self.started = False  # input has reached the engine: mode and rate are fixed
        self.closed = False
        self._origins: dict[int, FrameOrigin] = {}  # frame index -> its origin, until answered
        self._appended_since_commit_bytes = 0
        self.committed_ms = 0.0  # input stream position of the last commit
        self._last_item_id: str | None = None
        self._client_response_id: str | None = None
        self._client_response_index: int | None = None  # its frame, once in the beat
        self._interrupt_pending = False  # cancel the response as soon as it is in the beat
        self.turns: TurnDetection | None = None  # server VAD; None: the client commits

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self.emit(p.SessionCreated(session=self._describe()))

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
        """The engine bound this session under KV pressure: tell the client."""
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
            case p.ConversationItemCreate():
                self._create_item(event.item)
            case p.ResponseCreate():
                self._create_response()

    def _update(self, update: p.SessionIn) -> None:
        settings = self.settings.updated(update, self.host.config, self.host.chat is not None)
        current = self.settings
        if (settings.mode, settings.sample_rate_hz) != (current.mode, current.sample_rate_hz):
            self._reconfigure(settings)
        self.settings = settings
        self._set_turns(settings.turns)
        self.emit(p.SessionUpdated(session=self._describe()))

    def _set_turns(self, turns: p.ServerVad | None) -> None:
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
        pcm = decode_pcm16(audio_b64)
        framer = self.framer
        buffered_s = self._unanswered_s() + (framer.pending_bytes + len(pcm)) / framer.bytes_per_s
        if buffered_s > self.host.config.max_buffered_audio_s:
            raise ClientError(
                ErrorCode.BUFFER_OVERFLOW,
                f"audio is arriving faster than real time: {buffered_s:.2f} s would be "
                f"unanswered (limit {self.host.config.max_buffered_audio_s} s); this chunk "
                "was dropped", "audio",
            )
        self._check_input_room(framer.tokens(framer.pending_bytes + len(pcm)),
                               "audio", ErrorCode.BUFFER_OVERFLOW, "audio")
        self._appended_since_commit_bytes += len(pcm)
        for cut in framer.cut(pcm):
            self._encode_then_submit(cut)
        if self.turns is not None:
            self.turns.push(pcm)

    def _unanswered_s(self) -> float:
        """Input the beat has not answered yet, counting every frame as one period."""
        return self.record.unanswered_frames * self.host.config.frame_period_s

    def _check_input_room(self, num_tokens: int, what: str, code: ErrorCode,
                          param: str | None = None) -> None:
        """Refuse input that would leave more of this session's input unprocessed than its
        bound allows (`max_queued_input_tokens`, checked by the record); nothing is
        accepted, so nothing is lost."""
        record = self.record
        if record.fits(num_tokens):
            return
        limit, queued = record.profile.max_queued_input_tokens, record.queued_input_tokens
        advice = (f"it alone exceeds the limit: send it in parts of at most {limit} tokens"
                  if num_tokens > limit else "retry once the engine has caught up")
        raise ClientError(code, f"{what} of {num_tokens} tokens refused: {queued} tokens of "
                          f"this session's input are not processed yet (limit {limit}); "
                          f"{advice}", param)

    def _check_room_for_a_frame(self) -> None:
        limit_s = self.host.config.max_buffered_audio_s
        if self._unanswered_s() + self.host.config.frame_period_s > limit_s:
            raise ClientError(ErrorCode.TOO_MANY_PENDING, f"{self.record.unanswered_frames} "
                              f"frames are still unanswered (limit {limit_s:g} s of frames); "
                              "retry later")

    def _commit(self, item_id: str | None = None) -> None:
        """The buffer becomes a user item: `item_id` (a turn's), the speech under way's, or a
        new one."""
        if not self._appended_since_commit_bytes:
            raise ClientError(ErrorCode.COMMIT_EMPTY, "no audio appended since the last commit")
        self._appended_since_commit_bytes = 0
        self.committed_ms = self.framer.received_ms
        self._encode_then_submit(self.framer.cut_rest())
        # a commit mid-speech takes the turn's item id with it
        turn_item_id = self.turns.take_item_id() if self.turns is not None else None
        item_id = item_id or turn_item_id or p.new_id("item")
        item = p.ItemOut(id=item_id, role="user", content=[p.ContentOut(type="input_audio")])
        self.emit(p.InputAudioBufferCommitted(item_id=item.id,
                                              previous_item_id=self._last_item_id))
        self._add_item(item)

    def _create_item(self, item: p.MessageItemIn) -> None:
        chat = self._chat()
        text = "".join(part.text for part in item.content)
        if len(text) > self.host.config.max_text_chars:
            raise ClientError(ErrorCode.TEXT_TOO_LONG, f"text has {len(text)} characters; "
                              f"the limit is {self.host.config.max_text_chars}", "item.content")
        self._check_room_for_a_frame()
        token_ids = chat.item_ids(item.role, text)
        self._check_input_room(len(token_ids), "text item", ErrorCode.TOO_MANY_PENDING,
                               "item.content")
        self._add_item(p.ItemOut(id=item.id or p.new_id("item"), role=item.role,
                                 content=[p.ContentOut(type="input_text", text=text)]))
        self._queue_frame("text", lambda: Input(token_ids=token_ids), len(token_ids))

    def _create_response(self) -> None:
        chat = self._chat()
        if self._client_response_id is not None:
            raise ClientError(ErrorCode.ACTIVE_RESPONSE,
                              f"response {self._client_response_id} is still in progress")
        self._check_room_for_a_frame()
        token_ids = chat.response_prefix_ids
        self._check_input_room(len(token_ids), "response", ErrorCode.TOO_MANY_PENDING)
        response_id = self._new_response()
        self._client_response_id = response_id
        self._queue_frame("response", lambda: Input(token_ids=token_ids), len(token_ids),
                          respond=True, response_id=response_id)

    def _chat(self) -> ChatText:
        if self.host.chat is None:
            raise ClientError(ErrorCode.TEXT_UNSUPPORTED, "this model has no tokenizer: "
                              "text items and text responses are not available")
        return self.host.chat

    def _add_item(self, item: p.ItemOut) -> None:
        self.emit(p.ConversationItemAdded(previous_item_id=self._last_item_id, item=item))
        self._last_item_id = item.id

    # ---- turns (server VAD: `TurnTaker`) -------------------------------------------------
    def end_turn(self, item_id: str) -> None:
        if not self._appended_since_commit_bytes:
            return  # the client committed this speech already
        self._commit(item_id)
        if self.turns.settings.create_response and self.settings.mode is SessionMode.TURN:
            self._respond_to_turn()

    def _respond_to_turn(self) -> None:
        """`response.create` on the client's behalf; what would refuse it is told as an
        `error` (e.g. a response still under way with interrupt_response off)."""
        try:
            self._create_response()
        except ClientError as err:
            self.emit(p.ErrorEvent.of(err))

    def interrupt_response(self) -> None:
        """Cancel the response under way (its frame: in the beat now, or once it is)."""
        if self._client_response_id is None:
            return
        if self._client_response_index is None:
            self._interrupt_pending = True  # its input is still on the encoder thread
            return
        self.host.cancel_frame(self.engine_session_id, self._client_response_index,
                               TURN_DETECTED)

    # ---- frames ------------------------------------------------------------------------
    def _encode_then_submit(self, cut: PcmCut) -> None:
        framer = self.framer
        self._queue_frame("audio", lambda: Input(embeddings=framer.encode(cut)),
                          framer.tokens(len(cut.pcm)),
                          respond=self.settings.mode is SessionMode.DUPLEX,
                          audio_end_ms=cut.audio_end_ms)

    def _queue_frame(self, kind: FrameKind, make_input: Callable[[], Input], num_tokens: int,
                     respond: bool = False, audio_end_ms: float | None = None,
                     response_id: str | None = None) -> None:
        """Every frame passes the encoder thread's queue (audio to be encoded there, text as
        it is), so frames reach the beat in the order the client sent them and no encoding
        runs on the loop. It is accepted in the beat's record now (its input was checked
        against the session's bound) and arrives now (audio: when its last byte did), so
        encoding time counts in its latency."""
        self.started = True
        accepted = self.host.accept(self.engine_session_id, num_tokens)
        arrival_s = self.host.now_s()
        self.host.encode(make_input).add_done_callback(lambda done: self._on_input_ready(
            done, accepted, kind, respond, audio_end_ms, response_id, arrival_s))

    def _on_input_ready(self, done: asyncio.Future, accepted: Accepted, kind: FrameKind,
                        respond: bool, audio_end_ms: float | None, response_id: str | None,
                        arrival_s: float) -> None:
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
        if response_id is None and self.profile.output_tokens_for(respond) > 0:
            response_id = self._new_response()
        index = self.record.frames_submitted  # frames are numbered as they reach the beat
        assert index not in self._origins, (index, self._origins)
        self._origins[index] = FrameOrigin(kind, frame_input.num_tokens, response_id,
                                           response_id and p.new_id("item"), audio_end_ms)
        if kind == "response":
            self._client_response_index = index
        self.host.submit(Frame(self.engine_session_id, index, arrival_s, frame_input.token_ids,
                               frame_input.embeddings, respond), accepted)  # may answer at once
        if kind == "response" and self._interrupt_pending:
            self._interrupt_pending = False
            self.host.cancel_frame(self.engine_session_id, index, TURN_DETECTED)

    def _new_response(self) -> str:
        response_id = p.new_id("resp")
        self.emit(response_created(response_id))
        return response_id

    def _on_result_guarded(self, result: FrameResult) -> None:
        try:
            self.on_result(result)
        except Exception:  # one session's failure must not stop the beat for the others
            log.exception("session %s failed on a frame result", self.id)
            self.on_failure()

    def on_result(self, result: FrameResult) -> None:
        origin = self._origins.pop(result.index)  # every frame is answered exactly once
        text = self._text_of(result.token_ids, flush=origin.kind == "response")
        for event in result_events(result, origin, text):
            self.emit(event)
        if origin.kind == "response":
            self._client_response_id = self._client_response_index = None

    def _text_of(self, token_ids: list[int], flush: bool) -> str:
        if self.decoder is None:
            return ""
        text = self.decoder.push(token_ids)
        return text + self.decoder.flush() if flush else text

    # ---- descriptions --------------------------------------------------------------------
    def _describe(self) -> p.SessionOut:
        return self.settings.describe(self.id, self.host.model_name, self.profile,
                                      self._policy(), self.host.config.token_rate_hz)

    def _policy(self):
        """The KV bound in force: the profile's, or the one KV pressure imposed."""
        if self.closed:
            return self.profile.policy
        return self.record.policy

    def summary(self, now_s: float, resident_kv_tokens: int | None) -> dict:
        """What `GET /v1/sessions` shows of this session."""
        record = self.record
        last = record.last_status
        return {
            "id": self.id, "status": "ended" if record.ended_reason else "active",
            "ended_reason": record.ended_reason or None, "mode": self.settings.mode.value,
            "policy": str(record.policy),
            "sample_rate_hz": self.settings.sample_rate_hz,
            "age_s": round(now_s - self.opened_at_s, 3),
            "engine_session_id": self.engine_session_id,
            "resident_kv_tokens": resident_kv_tokens,
            "frames_submitted": record.frames_submitted,
            "frames_answered": record.frames_answered,
            "last_frame_status": None if last is None else last.value,
            "unanswered_frames": record.unanswered_frames,
            "queued_input_tokens": record.queued_input_tokens,
        }
