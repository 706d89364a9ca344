"""One Realtime session: client events in, frames to the beat, frame results out as events.

Owns the session's settings (mode, input rate), its audio framer and what each of its
frames belongs to (a `FrameOrigin`, carried by the frame through the beat and handed back
with its result). The runtime's session record (`runtime.record`) holds the frames
themselves. No socket here: events come in through `handle` (already parsed), go out
through `emit`, and `ClientError` means "answer with an error, the session is unchanged".
The host (`serve.state`) provides the beat, the clock and the audio encoder thread: audio
is cut into frames on the loop and encoded there, off the loop.

Responses: a frame whose profile asks for output is one response
(`response.created` at submit, then `response.output_text.delta`, `metronome.frame`,
`response.done` when the beat answers it). In duplex mode that is every frame, so text
streams back per frame with no commit; in turn mode audio frames only prefill (they get a
`metronome.frame`, no response) and a reply is the frame that `response.create` submits.
Mode and input rate are fixed once input has started: the engine session's profile is.

Turns (`turn_detection: server_vad`, `serve.turn_detection`): the VAD thread hears speech
start (`input_audio_buffer.speech_started`; with `interrupt_response`, the response under
way is cancelled, `turn_detected`) and stop (`speech_stopped`, then the buffer is committed
as the turn's item and, in turn mode with `create_response`, a response is created), as if
the client had sent the commit and the `response.create`. All the audio still reaches the
engine as frames: `prefix_padding_ms` only places the item's start in the events.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from metronome.audio.frontend import AudioFrontEnd
from metronome.audio.pcm import PCM16_BYTES_PER_SAMPLE
from metronome.audio.turn_detector import SpeechStarted, SpeechStopped, TurnEvent
from metronome.engine.types import Rebound
from metronome.runtime.frame import Frame, FrameResult, FrameStatus, count_input_tokens
from metronome.runtime.profile import SessionMode, SessionProfile
from metronome.runtime.record import SessionRecord
from metronome.serve import protocol as p
from metronome.serve.audio_input import AudioFramer, PcmCut
from metronome.serve.config import ServerConfig
from metronome.serve.kv_events import BoundOut, MetronomeSessionBounded
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.text import ChatText
from metronome.serve.turn_detection import TurnDetection, VadHost

log = logging.getLogger(__name__)
FrameKind = Literal["audio", "text", "response"]
TURN_DETECTED = "turn_detected"  # a response cancelled because the user spoke (OpenAI's)


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

    def submit(self, frame: Frame) -> None: ...

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


@dataclass
class FrameOrigin:
    """What a frame belongs to, for the events its result becomes."""

    kind: FrameKind
    num_input_tokens: int
    response_id: str | None  # None: no output asked for (turn-mode prefill)
    output_item_id: str | None
    audio_end_ms: float | None


_RESPONSE_STATUS = {  # frame status -> (response status, reason)
    FrameStatus.OK: ("completed", None),
    FrameStatus.LATE: ("incomplete", "deadline"),
    FrameStatus.CANCELLED: ("cancelled", "session_closed"),  # unless TURN_DETECTED
}


class RealtimeSession:
    def __init__(self, host: SessionHost, emit: Callable[[p.ServerEvent], None],
                 on_failure: Callable[[], None]) -> None:
        self.id = p.new_id("sess")
        self.host = host
        self.emit = emit
        self.on_failure = on_failure  # a bug in this session: its connection ends it (1011)
        config = host.config
        self.mode = config.mode
        self.sample_rate_hz = config.default_sample_rate_hz
        self.profile = config.profile(self.mode)
        self.opened_at_s = host.now_s()
        self.engine_session_id = self._open_engine_session()
        self.framer = AudioFramer(host.frontend(self.sample_rate_hz), config.frame_period_s)
        self.decoder = host.chat.decoder() if host.chat else None
        self.started = False  # input has reached the engine: mode and rate are fixed
        self.closed = False
        self.frames_created = 0  # frame indexes, in the order frames reach the beat
        self.frames_encoding = 0  # queued on the encoder thread, not yet in the beat
        self.tokens_encoding = 0  # their input tokens (audio: one frame's worth each)
        self._appended_since_commit_bytes = 0
        self._committed_ms = 0.0  # input stream position of the last commit
        self._last_item_id: str | None = None
        self._client_response_id: str | None = None
        self._client_response_index: int | None = None  # its frame, once in the beat
        self._interrupt_pending = False  # cancel the response as soon as it is in the beat
        self.turns: TurnDetection | None = None  # server VAD; None: the client commits
        self._turn_item_id: str | None = None  # the item the speech under way will become

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
        mode, rate_hz = self.mode, self.sample_rate_hz
        if update.metronome is not None and update.metronome.mode is not None:
            mode = SessionMode(update.metronome.mode)
        audio_in = update.audio.input if update.audio else None
        if audio_in is not None and audio_in.format is not None:
            rate_hz = audio_in.format.rate
        if rate_hz not in self.host.config.sample_rates_hz:
            raise ClientError(
                ErrorCode.UNSUPPORTED_SAMPLE_RATE,
                f"rate {rate_hz} Hz is not served; use one of {self.host.config.sample_rates_hz}",
                "session.audio.input.format.rate",
            )
        turns = self.turns.settings if self.turns else None
        if audio_in is not None and "turn_detection" in audio_in.model_fields_set:
            turns = audio_in.turn_detection
        self._check_turns(turns, mode)
        if (mode, rate_hz) != (self.mode, self.sample_rate_hz):
            self._reconfigure(mode, rate_hz)
        self._set_turns(turns)
        self.emit(p.SessionUpdated(session=self._describe()))

    def _check_turns(self, turns: p.ServerVad | None, mode: SessionMode) -> None:
        if (turns is not None and turns.create_response and mode is SessionMode.TURN
                and self.host.chat is None):
            raise ClientError(ErrorCode.TEXT_UNSUPPORTED, "this model has no tokenizer, so "
                              "server VAD cannot create text responses: set create_response "
                              "to false", "session.audio.input.turn_detection.create_response")

    def _set_turns(self, turns: p.ServerVad | None) -> None:
        """Start, restart (new settings or rate) or stop server VAD from where audio stands."""
        current = self.turns
        if current is not None and (current.settings, current.sample_rate_hz) == (
                turns, self.sample_rate_hz):
            return  # the same settings again: the speech under way goes on
        if current is not None:
            current.stop()
        self._turn_item_id = None
        self.turns = None if turns is None else TurnDetection(
            turns, self.host, self.sample_rate_hz, self.framer.received_ms, self._on_turn,
            self.on_failure)

    def _reconfigure(self, mode: SessionMode, rate_hz: int) -> None:
        if self.started or self.framer.received_bytes:
            raise ClientError(ErrorCode.SESSION_LOCKED,
                              "mode and input format are fixed once input has started",
                              "session")
        if mode is not self.mode:  # nothing submitted yet: a fresh engine session is free
            self.host.close_session(self.engine_session_id)
            self.profile = self.host.config.profile(mode)
            self.engine_session_id = self._open_engine_session()
        self.mode, self.sample_rate_hz = mode, rate_hz
        self.framer = AudioFramer(self.host.frontend(rate_hz), self.host.config.frame_period_s)

    def _append(self, audio_b64: str) -> None:
        if not self.host.accepts_audio:
            raise ClientError(ErrorCode.AUDIO_UNSUPPORTED, "this server's engine takes text "
                              "only (vLLM's streaming input refuses embeddings): send text "
                              "items with conversation.item.create", "audio")
        pcm = _decode_pcm16(audio_b64)
        framer = self.framer
        buffered_s = self._unanswered_s() + (framer.pending_bytes + len(pcm)) / framer.bytes_per_s
        if buffered_s > self.host.config.max_buffered_audio_s:
            raise ClientError(
                ErrorCode.BUFFER_OVERFLOW,
                f"audio is arriving faster than real time: {buffered_s:.2f} s would be "
                f"unanswered (limit {self.host.config.max_buffered_audio_s} s); this chunk "
                "was dropped", "audio",
            )
        self._check_input_room(self._audio_tokens(framer.pending_bytes + len(pcm)),
                               "audio", ErrorCode.BUFFER_OVERFLOW, "audio")
        self._appended_since_commit_bytes += len(pcm)
        for cut in framer.cut(pcm):
            self._encode_then_submit(cut)
        if self.turns is not None:
            self.turns.push(pcm)

    @property
    def unanswered_frames(self) -> int:
        """Frames not answered yet: being encoded, or in the beat."""
        return self.frames_encoding + self.record.unanswered_frames

    def _unanswered_s(self) -> float:
        """Input the beat has not answered yet, counting every frame as one period."""
        return self.unanswered_frames * self.host.config.frame_period_s

    @property
    def queued_input_tokens(self) -> int:
        """Input accepted but not processed yet: on the encoder thread, or queued in the
        beat and the engine (late frames' leftover input included)."""
        return self.tokens_encoding + self.record.queued_input_tokens

    def _audio_tokens(self, num_bytes: int) -> int:
        return math.ceil(num_bytes / self.framer.bytes_per_s * self.host.config.token_rate_hz)

    def _check_input_room(self, num_tokens: int, what: str, code: ErrorCode,
                          param: str | None = None) -> None:
        """Refuse input that would leave more of this session's input unprocessed than the
        server allows (`max_queued_input_tokens`); nothing is accepted, so nothing is lost."""
        limit = self.host.config.max_queued_input_tokens
        queued = self.queued_input_tokens
        if queued + num_tokens <= limit:
            return
        advice = (f"it alone exceeds the limit: send it in parts of at most {limit} tokens"
                  if num_tokens > limit else "retry once the engine has caught up")
        raise ClientError(code, f"{what} of {num_tokens} tokens refused: {queued} tokens of "
                          f"this session's input are not processed yet (limit {limit}); "
                          f"{advice}", param)

    def _check_room_for_a_frame(self) -> None:
        limit_s = self.host.config.max_buffered_audio_s
        if self._unanswered_s() + self.host.config.frame_period_s > limit_s:
            raise ClientError(ErrorCode.TOO_MANY_PENDING, f"{self.unanswered_frames} frames "
                              f"are still unanswered (limit {limit_s:g} s of frames); retry "
                              "later")

    def _commit(self, item_id: str | None = None) -> None:
        """The buffer becomes a user item: `item_id` (a turn's), the speech under way's, or a
        new one."""
        if not self._appended_since_commit_bytes:
            raise ClientError(ErrorCode.COMMIT_EMPTY, "no audio appended since the last commit")
        self._appended_since_commit_bytes = 0
        self._committed_ms = self.framer.received_ms
        self._encode_then_submit(self.framer.cut_rest())
        item_id = item_id or self._turn_item_id or p.new_id("item")
        self._turn_item_id = None  # a commit mid-speech takes the turn's item id with it
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

    # ---- turns (server VAD) ---------------------------------------------------------------
    def _on_turn(self, event: TurnEvent) -> None:
        settings = self.turns.settings
        match event:
            case SpeechStarted():
                self._turn_item_id = p.new_id("item")
                start_ms = max(self._committed_ms, event.start_ms - settings.prefix_padding_ms)
                self.emit(p.InputAudioBufferSpeechStarted(audio_start_ms=round(start_ms),
                                                          item_id=self._turn_item_id))
                if settings.interrupt_response:
                    self._interrupt_response()
            case SpeechStopped():
                item_id = self._turn_item_id or p.new_id("item")  # or a client commit took it
                end_ms = event.end_ms + settings.silence_duration_ms
                self.emit(p.InputAudioBufferSpeechStopped(audio_end_ms=round(end_ms),
                                                          item_id=item_id))
                if not self._appended_since_commit_bytes:
                    return  # the client committed this speech already
                self._commit(item_id)
                if settings.create_response and self.mode is SessionMode.TURN:
                    self._respond_to_turn()

    def _respond_to_turn(self) -> None:
        """`response.create` on the client's behalf; what would refuse it is told as an
        `error` (e.g. a response still under way with interrupt_response off)."""
        try:
            self._create_response()
        except ClientError as err:
            self.emit(p.ErrorEvent.of(err))

    def _interrupt_response(self) -> None:
        """Cancel the response under way (its frame: in the beat now, or once it is)."""
        if self._client_response_id is None:
            return
        if self._client_response_index is None:
            self._interrupt_pending = True  # its input is still on the encoder thread
            return
        self.host.cancel_frame(self.engine_session_id, self._client_response_index,
                               TURN_DETECTED)

    def _chat(self) -> ChatText:
        if self.host.chat is None:
            raise ClientError(ErrorCode.TEXT_UNSUPPORTED, "this model has no tokenizer: "
                              "text items and text responses are not available")
        return self.host.chat

    def _add_item(self, item: p.ItemOut) -> None:
        self.emit(p.ConversationItemAdded(previous_item_id=self._last_item_id, item=item))
        self._last_item_id = item.id

    # ---- frames ------------------------------------------------------------------------
    def _encode_then_submit(self, cut: PcmCut) -> None:
        framer = self.framer
        self._queue_frame("audio", lambda: Input(embeddings=framer.encode(cut)),
                          self._audio_tokens(len(cut.pcm)),
                          respond=self.mode is SessionMode.DUPLEX, audio_end_ms=cut.audio_end_ms)

    def _queue_frame(self, kind: FrameKind, make_input: Callable[[], Input], num_tokens: int,
                     respond: bool = False, audio_end_ms: float | None = None,
                     response_id: str | None = None) -> None:
        """Every frame passes the encoder thread's queue (audio to be encoded there, text as
        it is), so frames reach the beat in the order the client sent them and no encoding
        runs on the loop. A frame arrives now (audio: when its last byte did), so encoding
        time counts in its latency."""
        self.started = True
        self.frames_encoding += 1
        self.tokens_encoding += num_tokens
        arrival_s = self.host.now_s()
        self.host.encode(make_input).add_done_callback(lambda done: self._on_input_ready(
            done, kind, respond, audio_end_ms, response_id, arrival_s, num_tokens))

    def _on_input_ready(self, done: asyncio.Future, kind: FrameKind, respond: bool,
                        audio_end_ms: float | None, response_id: str | None,
                        arrival_s: float, num_tokens: int) -> None:
        self.frames_encoding -= 1
        self.tokens_encoding -= num_tokens
        if self.closed or done.cancelled():
            return  # the session ended while its input was on the encoder thread
        if done.exception() is not None:
            log.error("session %s: preparing a frame failed", self.id,
                      exc_info=done.exception())
            self.on_failure()
            return
        frame_input: Input = done.result()
        if frame_input.num_tokens == 0 and kind == "audio":
            return  # a commit with less than a token of audio left: no frame
        if response_id is None and self.profile.output_tokens_for(respond) > 0:
            response_id = self._new_response()
        origin = FrameOrigin(kind, frame_input.num_tokens, response_id,
                             response_id and p.new_id("item"), audio_end_ms)
        index = self.frames_created
        self.frames_created += 1
        if kind == "response":
            self._client_response_index = index
        self.host.submit(Frame(self.engine_session_id, index, arrival_s, frame_input.token_ids,
                               frame_input.embeddings, respond, origin))  # may answer at once
        if kind == "response" and self._interrupt_pending:
            self._interrupt_pending = False
            self.host.cancel_frame(self.engine_session_id, index, TURN_DETECTED)

    def _new_response(self) -> str:
        response_id = p.new_id("resp")
        self.emit(p.ResponseCreated(response=p.ResponseOut(id=response_id, status="in_progress")))
        return response_id

    def _on_result_guarded(self, result: FrameResult) -> None:
        try:
            self.on_result(result)
        except Exception:  # one session's failure must not stop the beat for the others
            log.exception("session %s failed on a frame result", self.id)
            self.on_failure()

    def on_result(self, result: FrameResult) -> None:
        origin: FrameOrigin = result.origin
        text = self._text_of(result.token_ids, flush=origin.kind == "response")
        if origin.response_id is not None and text:
            self.emit(p.ResponseOutputTextDelta(response_id=origin.response_id,
                                                item_id=origin.output_item_id, delta=text))
        self.emit(p.MetronomeFrame(response_id=origin.response_id,
                                   frame=_frame_out(result, origin)))
        if origin.response_id is not None:
            self.emit(p.ResponseDone(response=_response_out(result, origin, text)))
        if origin.kind == "response":
            self._client_response_id = self._client_response_index = None

    def _text_of(self, token_ids: list[int], flush: bool) -> str:
        if self.decoder is None:
            return ""
        text = self.decoder.push(token_ids)
        return text + self.decoder.flush() if flush else text

    # ---- descriptions --------------------------------------------------------------------
    def _describe(self) -> p.SessionOut:
        config, profile = self.host.config, self.profile
        return p.SessionOut(
            id=self.id, model=self.host.model_name,
            audio=p.AudioOut(input=p.AudioInputOut(
                format=p.AudioFormatOut(rate=self.sample_rate_hz),
                turn_detection=self.turns.settings if self.turns else None)),
            metronome=p.MetronomeSessionOut(
                mode=self.mode.value, frame_period_s=profile.frame_period_s,
                deadline_s=profile.deadline_s,
                output_tokens_per_frame=profile.max_output_tokens_per_frame,
                policy=str(self._policy()), token_rate_hz=config.token_rate_hz,
            ),
        )

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
            "ended_reason": record.ended_reason or None, "mode": self.mode.value,
            "policy": str(record.policy),
            "sample_rate_hz": self.sample_rate_hz, "age_s": round(now_s - self.opened_at_s, 3),
            "engine_session_id": self.engine_session_id,
            "resident_kv_tokens": resident_kv_tokens,
            "frames_submitted": record.frames_submitted,
            "frames_answered": record.frames_answered,
            "last_frame_status": None if last is None else last.value,
            "unanswered_frames": self.unanswered_frames,
            "queued_input_tokens": self.queued_input_tokens,
        }


def _decode_pcm16(audio_b64: str) -> bytes:
    try:
        pcm = base64.b64decode(audio_b64, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ClientError(ErrorCode.INVALID_AUDIO, f"audio is not valid base64: {err}",
                          "audio") from None
    if not pcm or len(pcm) % PCM16_BYTES_PER_SAMPLE:
        raise ClientError(ErrorCode.INVALID_AUDIO, f"audio/pcm needs whole 16-bit samples; got "
                          f"{len(pcm)} bytes", "audio")
    return pcm


def _frame_out(result: FrameResult, origin: FrameOrigin) -> p.FrameOut:
    return p.FrameOut(
        index=result.index, kind=origin.kind, status=result.status.value, reason=result.reason,
        num_input_tokens=origin.num_input_tokens, num_tokens=len(result.token_ids),
        arrival_s=result.arrival_s, start_s=result.start_s, finish_s=result.finish_s,
        deadline_at_s=result.deadline_at_s, latency_ms=result.latency_s * 1e3,
        deadline_met=result.deadline_met, good=result.good, audio_end_ms=origin.audio_end_ms,
    )


def _response_out(result: FrameResult, origin: FrameOrigin, text: str) -> p.ResponseOut:
    status, reason = _RESPONSE_STATUS.get(result.status, ("failed", None))
    if result.status is FrameStatus.CANCELLED and result.reason == TURN_DETECTED:
        reason = TURN_DETECTED
    error = None
    if status == "failed":
        error = {"type": p.ErrorType.SERVER.value, "code": result.status.value,
                 "message": result.reason}
    item = p.ItemOut(id=origin.output_item_id, role="assistant",
                     status="completed" if status == "completed" else "incomplete",
                     content=[p.ContentOut(type="output_text", text=text)])
    num_output = len(result.token_ids)
    return p.ResponseOut(
        id=origin.response_id, status=status,
        status_details=p.StatusDetails(type=status, reason=reason, error=error),
        output=[item],
        usage=p.Usage(total_tokens=origin.num_input_tokens + num_output,
                      input_tokens=origin.num_input_tokens, output_tokens=num_output),
    )
