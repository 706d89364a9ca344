"""The server events this server sends, typed, in OpenAI's shapes (Realtime API GA;
`tests/serve/test_serve_conformance.py` parses every one the server tests see with the
`openai` package's own server-event union, strictly), and the `metronome.*` extensions
(sent only to a client that opted in: `?metronome_events=true`).

Every event carries an `event_id`; errors have OpenAI's shape `{"type": "error",
"event_id", "error": {type, code, message, param, event_id}}`, where the inner `event_id`
names the client event that caused it.

A response's events, in OpenAI's order: `response.created`, `response.output_item.added`,
`conversation.item.added`, `response.content_part.added`, then, when the beat answers its
frame, `response.output_text.delta` (if any text), `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`, `conversation.item.done`,
`response.done`. A user item: `conversation.item.added`, `conversation.item.done`.

Extensions: `metronome.frame` (a frame's status and server-side timing);
`metronome.session.resumed`, the first event on a connection that resumed the session
(`serve.resume`): the session (with the next resume token), how long the client was away,
and how many events follow that it missed (then the live ones); `metronome.session.bounded`:
the server's opt-in graceful degradation (`degrade_policy`) switched this unbounded session
to a sinks+window bound because the KV pool ran dry (its middle blocks went back to the pool;
from now on it attends to its sinks and its window only, and keeps its beat).
"""

from __future__ import annotations

import secrets
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from metronome.serve.protocol.errors import ClientError, ErrorCode, ErrorType
from metronome.serve.protocol.schema import SessionOut


def text_bytes(text: str) -> int:
    """The UTF-8 size of a text message, without encoding an ASCII one (O(1) to tell)."""
    return len(text) if text.isascii() else len(text.encode())


def new_id(prefix: str) -> str:
    """OpenAI-style ids: `event_...`, `item_...`, `resp_...`, `sess_...`."""
    return f"{prefix}_{secrets.token_hex(10)}"


# ---- server events ------------------------------------------------------------------------
class ServerEvent(BaseModel):
    event_id: str = Field(default_factory=lambda: new_id("event"))

    def to_json(self) -> str:
        return self.model_dump_json()


class ErrorDetail(BaseModel):
    type: ErrorType
    code: ErrorCode
    message: str
    param: str | None = None
    event_id: str | None = None  # the client event that caused the error


class ErrorEvent(ServerEvent):
    type: Literal["error"] = "error"
    error: ErrorDetail

    @classmethod
    def of(cls, err: ClientError, client_event_id: str | None = None) -> ErrorEvent:
        return cls(error=ErrorDetail(type=err.error_type, code=err.code, message=err.message,
                                     param=err.param, event_id=client_event_id))


class SessionCreated(ServerEvent):
    type: Literal["session.created"] = "session.created"
    session: SessionOut


class SessionUpdated(ServerEvent):
    type: Literal["session.updated"] = "session.updated"
    session: SessionOut


class InputAudioBufferCommitted(ServerEvent):
    type: Literal["input_audio_buffer.committed"] = "input_audio_buffer.committed"
    item_id: str
    previous_item_id: str | None = None


class InputAudioBufferSpeechStarted(ServerEvent):
    """Server VAD heard speech begin. `audio_start_ms` (of the session's input audio) is
    where the item's audio begins: the detected start less `prefix_padding_ms`, never before
    the previous commit."""

    type: Literal["input_audio_buffer.speech_started"] = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str  # the user item that speech stop will commit


class InputAudioBufferSpeechStopped(ServerEvent):
    """Server VAD heard speech end. `audio_end_ms` is where the item's audio ends: the
    detected end plus `silence_duration_ms` (the silence that confirmed it)."""

    type: Literal["input_audio_buffer.speech_stopped"] = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


class ContentOut(BaseModel):
    type: Literal["input_text", "input_audio", "output_text", "output_audio"]
    text: str | None = None  # absent for audio
    transcript: str | None = None  # absent: no ASR is served (and a system part has none)

    @model_serializer(mode="wrap")
    def _without_absent(self, handler):
        return {key: value for key, value in handler(self).items() if value is not None}


class ItemOut(BaseModel):
    id: str
    object: Literal["realtime.item"] = "realtime.item"
    type: Literal["message"] = "message"
    role: Literal["user", "system", "assistant"]
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    content: list[ContentOut]


class _ConversationItemEvent(ServerEvent):
    previous_item_id: str | None = None
    item: ItemOut


class ConversationItemAdded(_ConversationItemEvent):
    type: Literal["conversation.item.added"] = "conversation.item.added"


class ConversationItemDone(_ConversationItemEvent):
    type: Literal["conversation.item.done"] = "conversation.item.done"


class ConversationItemTruncated(ServerEvent):
    """The unheard part of an assistant item left the conversation (and the KV)."""

    type: Literal["conversation.item.truncated"] = "conversation.item.truncated"
    item_id: str
    content_index: int
    audio_end_ms: int


class ConversationItemRetrieved(ServerEvent):
    type: Literal["conversation.item.retrieved"] = "conversation.item.retrieved"
    item: ItemOut


class InputAudioBufferCleared(ServerEvent):
    type: Literal["input_audio_buffer.cleared"] = "input_audio_buffer.cleared"


StatusReason = Literal["turn_detected", "client_cancelled", "max_output_tokens"]


class StatusDetails(BaseModel):
    type: Literal["completed", "cancelled", "incomplete", "failed"]
    # cancelled: `turn_detected` (server VAD) or `client_cancelled` (response.cancel);
    # incomplete: `max_output_tokens` (its budget ran out before the model stopped); a late
    # frame is `incomplete` with no reason of OpenAI's (its `metronome.frame` says "late")
    reason: StatusReason | None = None
    error: dict[str, str] | None = None  # failed: {type, code, message}


class Usage(BaseModel):
    total_tokens: int
    input_tokens: int
    output_tokens: int


class ResponseOut(BaseModel):
    id: str
    object: Literal["realtime.response"] = "realtime.response"
    status: Literal["in_progress", "completed", "cancelled", "incomplete", "failed"]
    status_details: StatusDetails | None = None
    output_modalities: list[Literal["text", "audio"]] = ["text"]
    output: list[ItemOut] = []
    usage: Usage | None = None
    metadata: dict[str, str] | None = None  # response.create's, echoed


class ResponseCreated(ServerEvent):
    type: Literal["response.created"] = "response.created"
    response: ResponseOut


class _ContentEvent(ServerEvent):
    """An event about one content part of a response's output item."""

    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0


class ResponseOutputTextDelta(_ContentEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str


class ResponseOutputTextDone(_ContentEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str


class ResponseOutputAudioDelta(_ContentEvent):
    type: Literal["response.output_audio.delta"] = "response.output_audio.delta"
    delta: str  # base64 PCM16 at the session's output rate


class ResponseOutputAudioDone(_ContentEvent):
    type: Literal["response.output_audio.done"] = "response.output_audio.done"


class ResponseOutputAudioTranscriptDelta(_ContentEvent):
    type: Literal["response.output_audio_transcript.delta"] = (
        "response.output_audio_transcript.delta")
    delta: str


class ResponseOutputAudioTranscriptDone(_ContentEvent):
    type: Literal["response.output_audio_transcript.done"] = (
        "response.output_audio_transcript.done")
    transcript: str


class PartOut(BaseModel):
    type: Literal["text"] = "text"
    text: str = ""


class AudioPartOut(BaseModel):
    type: Literal["audio"] = "audio"
    transcript: str = ""


class ResponseContentPartAdded(_ContentEvent):
    type: Literal["response.content_part.added"] = "response.content_part.added"
    part: PartOut | AudioPartOut


class ResponseContentPartDone(_ContentEvent):
    type: Literal["response.content_part.done"] = "response.content_part.done"
    part: PartOut | AudioPartOut


class _TranscriptionEvent(ServerEvent):
    """An event about the transcript of a user item's audio part."""

    item_id: str
    content_index: int = 0


class InputAudioTranscriptionDelta(_TranscriptionEvent):
    type: Literal["conversation.item.input_audio_transcription.delta"] = (
        "conversation.item.input_audio_transcription.delta")
    delta: str


class InputAudioTranscriptionCompleted(_TranscriptionEvent):
    type: Literal["conversation.item.input_audio_transcription.completed"] = (
        "conversation.item.input_audio_transcription.completed")
    transcript: str
    usage: DurationUsage


class DurationUsage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: float  # of audio heard


class _OutputItemEvent(ServerEvent):
    response_id: str
    output_index: int = 0
    item: ItemOut


class ResponseOutputItemAdded(_OutputItemEvent):
    type: Literal["response.output_item.added"] = "response.output_item.added"


class ResponseOutputItemDone(_OutputItemEvent):
    type: Literal["response.output_item.done"] = "response.output_item.done"


class ResponseDone(ServerEvent):
    type: Literal["response.done"] = "response.done"
    response: ResponseOut


class FrameOut(BaseModel):
    """One frame's answer, timed on the server clock (seconds since the server started)."""

    index: int
    kind: Literal["audio", "text", "response"]
    status: str  # ok | late | stalled_kv | context_full | rejected | cancelled
    reason: str
    num_input_tokens: int
    num_tokens: int
    arrival_s: float  # the frame was complete at the server
    start_s: float | None
    finish_s: float
    deadline_at_s: float
    latency_ms: float  # finish - arrival: the server-side frame latency
    deadline_met: bool
    good: bool
    audio_end_ms: float | None  # audio frames: the input stream position the frame ends at


class MetronomeFrame(ServerEvent):
    type: Literal["metronome.frame"] = "metronome.frame"
    response_id: str | None
    frame: FrameOut


class ReplyOut(BaseModel):
    """A reply as its listener had it (`serve.realtime.pacing`), on the server's clock."""

    first_output_ms: float | None  # from the reply's request (response.create, or the end
    # of the turn that made it) to its first text or audio sent; None: it sent none
    output_tokens: int
    played_ms: float  # the audio sent (spoken), or the text's reading time at the pace
    pace_tokens_per_s: float | None  # a text reply's reading pace (None: spoken)
    gap_count: int  # times the listener ran dry before the next piece arrived
    gap_ms: float  # how long, in all
    max_gap_ms: float


class MetronomeReply(ServerEvent):
    type: Literal["metronome.reply"] = "metronome.reply"
    response_id: str
    reply: ReplyOut


# ---- metronome.* extensions ----------------------------------------------------------
class BoundOut(BaseModel):
    policy: str  # the bound now in force, e.g. sinks_window:4:512@absolute
    # kv_pressure: an unbounded session bound as the pool ran dry (--degrade-policy);
    # position_limit: the session reached the model's trained positions and goes on under
    # rolling positions (it never ends); pinned: its instructions were re-pinned
    reason: Literal["kv_pressure", "position_limit", "pinned"] = "kv_pressure"
    freed_blocks: int  # returned to the pool when it was bound
    resident_kv_tokens: int  # the session's live KV right after


class MetronomeSessionBounded(ServerEvent):
    type: Literal["metronome.session.bounded"] = "metronome.session.bounded"
    session_id: str
    bound: BoundOut


class BehindOut(BaseModel):
    """The server fell behind a client sending audio at real time: its audio is kept."""

    unanswered_audio_s: float  # the session's audio not answered yet, this chunk included
    ahead_of_real_time_s: float  # how far the client's audio is ahead of the wall clock
    kept_up_to_s: float  # audio kept for it until then (--max-behind-audio-s); past it refused


class MetronomeInputBehind(ServerEvent):
    """Once per stretch behind (told again after the server caught up)."""

    type: Literal["metronome.input.behind"] = "metronome.input.behind"
    behind: BehindOut


class ResumedOut(BaseModel):
    away_s: float  # since the old connection dropped (0: it was taken over while open)
    replayed_events: int  # the missed events that follow, in order
    missed_events: int  # owed but no longer held (the session's event stream moved on)
    # Taken over on another server from its last checkpoint (`serve.resume.takeover`): the
    # events that follow are made anew by replaying the client's events since the checkpoint
    # (`replayed_client_events`); they supersede what the client had after the checkpoint.
    from_checkpoint: bool = False
    replayed_client_events: int = 0
    # The client's events the session holds, counted in the order sent (events answered
    # with an `error` are not counted; events still queued behind a take-over's replay
    # are), and the last one's `event_id` (None: it had none, or a checkpoint older than
    # this field): any the client sent after that one never reached the session (lost
    # with the connection, or with a server that died before logging them): send them
    # again. Match on the id (give events unique ids); the count is the fallback.
    client_events: int = 0
    last_client_event_id: str | None = None


class MetronomeSessionResumed(ServerEvent):
    type: Literal["metronome.session.resumed"] = "metronome.session.resumed"
    session: SessionOut
    resumed: ResumedOut
