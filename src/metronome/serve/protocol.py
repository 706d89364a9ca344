"""The wire protocol: the subset of the OpenAI Realtime API (GA) we speak, as typed events.

Client events are parsed into a discriminated union on `type`; unknown parameters are
refused (as OpenAI does), so a client never believes a setting took effect when it did not.
A message is read as JSON at a cost bounded by its size (`serve.bounded_json`): too many
values, too deep, or a lone surrogate in a string is `invalid_json`, before validation.
Server events carry an `event_id`; errors have OpenAI's shape
`{"type": "error", "event_id", "error": {type, code, message, param, event_id}}`, where the
inner `event_id` names the client event that caused it.

Extensions, namespaced: `session.metronome` (mode, frame timing) and the `metronome.frame`
event, one per frame, with its status and server-side timing.

Turn detection (`session.audio.input.turn_detection`): null (the client commits) or OpenAI's
`server_vad` with its fields and defaults; `semantic_vad` and `idle_timeout_ms` are not
served and are refused.
"""

from __future__ import annotations

import enum
import secrets
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
)

from metronome.serve.bounded_json import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_VALUES,
    JsonRefused,
    loads_bounded,
    param_of,
)

MAX_ID_CHARS = 128  # client-chosen ids (event_id, item id); longer ones are refused
MAX_VAD_MS = 60_000  # longest prefix padding or silence a turn detection may ask for


def text_bytes(text: str) -> int:
    """The UTF-8 size of a text message, without encoding an ASCII one (O(1) to tell)."""
    return len(text) if text.isascii() else len(text.encode())


def new_id(prefix: str) -> str:
    """OpenAI-style ids: `event_...`, `item_...`, `resp_...`, `sess_...`."""
    return f"{prefix}_{secrets.token_hex(10)}"


# ---- errors -------------------------------------------------------------------------------
class ErrorType(enum.StrEnum):
    INVALID_REQUEST = "invalid_request_error"  # the client's fault: fix the request
    SERVER = "server_error"  # ours, or capacity: retry later


class ErrorCode(enum.StrEnum):
    INVALID_JSON = "invalid_json"
    BINARY_NOT_SUPPORTED = "binary_not_supported"
    MESSAGE_TOO_LARGE = "message_too_large"
    UNKNOWN_EVENT_TYPE = "unknown_event_type"
    UNKNOWN_PARAMETER = "unknown_parameter"
    MISSING_PARAMETER = "missing_required_parameter"
    INVALID_VALUE = "invalid_value"
    INVALID_AUDIO = "invalid_audio"
    AUDIO_UNSUPPORTED = "audio_input_unsupported"
    UNSUPPORTED_SAMPLE_RATE = "unsupported_sample_rate"
    SESSION_LOCKED = "session_locked"
    TEXT_TOO_LONG = "text_too_long"
    TEXT_UNSUPPORTED = "text_input_unsupported"
    BUFFER_OVERFLOW = "input_audio_buffer_overflow"
    TOO_MANY_PENDING = "too_many_pending_frames"
    COMMIT_EMPTY = "input_audio_buffer_commit_empty"
    ACTIVE_RESPONSE = "conversation_already_has_active_response"
    IDLE_TIMEOUT = "idle_timeout"
    SESSION_EXPIRED = "session_expired"
    AT_CAPACITY = "server_at_capacity"
    SERVER_DRAINING = "server_draining"  # its drain timeout passed: reconnect elsewhere
    INVALID_API_KEY = "invalid_api_key"
    RATE_LIMITED = "rate_limit_exceeded"


class ClientError(Exception):
    """A client event that cannot be honoured; answered with an `error`, the session lives on."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None,
                 error_type: ErrorType = ErrorType.INVALID_REQUEST,
                 event_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.error_type = error_type
        self.event_id = event_id  # the client event's own id, when it could be read


# ---- client events ------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


ClientId = Annotated[str, Field(max_length=MAX_ID_CHARS)]


class AudioFormatIn(_Strict):
    type: Literal["audio/pcm"]  # PCM16 little-endian mono; pcmu / pcma are not supported
    rate: StrictInt = 24000


class ServerVad(_Strict):
    """`server_vad` turn detection, OpenAI's fields and defaults; in `session.update` and, with
    every default filled in, in the session's description."""

    type: Literal["server_vad"]
    threshold: StrictFloat = Field(0.5, ge=0.0, le=1.0)  # P(speech) that starts speech
    prefix_padding_ms: StrictInt = Field(300, ge=0, le=MAX_VAD_MS)  # before speech_started
    silence_duration_ms: StrictInt = Field(500, ge=0, le=MAX_VAD_MS)  # that ends a turn
    create_response: StrictBool = True  # turn mode: a response at each speech stop
    interrupt_response: StrictBool = True  # speech cancels the response under way
    idle_timeout_ms: None = None  # not served: null only


class AudioInputIn(_Strict):
    format: AudioFormatIn | None = None
    # absent: unchanged; null: the client commits (duplex frames or explicit commits)
    turn_detection: ServerVad | None = None


class AudioIn(_Strict):
    input: AudioInputIn | None = None


class MetronomeSessionIn(_Strict):
    mode: Literal["duplex", "turn"] | None = None


class SessionIn(_Strict):
    type: Literal["realtime"] = "realtime"
    model: ClientId | None = None  # accepted; the server serves one model and names it
    output_modalities: list[Literal["text"]] | None = None
    audio: AudioIn | None = None
    metronome: MetronomeSessionIn | None = None


class SessionUpdate(_Strict):
    type: Literal["session.update"]
    event_id: ClientId | None = None
    session: SessionIn


class InputAudioBufferAppend(_Strict):
    type: Literal["input_audio_buffer.append"]
    event_id: ClientId | None = None
    audio: str  # base64 of PCM16 samples in the session's input format


class InputAudioBufferCommit(_Strict):
    type: Literal["input_audio_buffer.commit"]
    event_id: ClientId | None = None


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class MessageItemIn(_Strict):
    id: ClientId | None = None
    type: Literal["message"]
    role: Literal["user", "system"]
    content: list[InputText] = Field(min_length=1, max_length=64)


class ConversationItemCreate(_Strict):
    type: Literal["conversation.item.create"]
    event_id: ClientId | None = None
    item: MessageItemIn


class ResponseParamsIn(_Strict):
    output_modalities: list[Literal["text"]] | None = None


class ResponseCreate(_Strict):
    type: Literal["response.create"]
    event_id: ClientId | None = None
    response: ResponseParamsIn | None = None


ClientEvent = Annotated[
    SessionUpdate | InputAudioBufferAppend | InputAudioBufferCommit | ConversationItemCreate
    | ResponseCreate,
    Field(discriminator="type"),
]
_CLIENT_EVENT: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
CLIENT_EVENT_TYPES = frozenset(
    m.model_fields["type"].annotation.__args__[0]
    for m in (SessionUpdate, InputAudioBufferAppend, InputAudioBufferCommit,
              ConversationItemCreate, ResponseCreate)
)


def parse_client_event(text: str, max_values: int = DEFAULT_MAX_VALUES,
                       max_depth: int = DEFAULT_MAX_DEPTH) -> ClientEvent:
    """One text message -> a typed event, or `ClientError` saying exactly what is wrong (with
    the event's `event_id` when it could be read). The work is bounded by the text's size
    and the two limits, whatever the message holds."""
    try:
        raw = loads_bounded(text, max_values, max_depth)
    except JsonRefused as err:
        raise ClientError(ErrorCode.INVALID_JSON, str(err), err.param) from None
    if not isinstance(raw, dict):
        raise ClientError(ErrorCode.INVALID_JSON, "an event must be a JSON object")
    event_id = raw.get("event_id")
    event_id = event_id if isinstance(event_id, str) and len(event_id) <= MAX_ID_CHARS else None
    event_type = raw.get("type")
    if not isinstance(event_type, str) or event_type not in CLIENT_EVENT_TYPES:
        shown = event_type if isinstance(event_type, str) else type(event_type).__name__
        supported = ", ".join(sorted(CLIENT_EVENT_TYPES))
        raise ClientError(ErrorCode.UNKNOWN_EVENT_TYPE,
                          f"unknown event type {shown[:64]!r}; supported: {supported}", "type",
                          event_id=event_id)
    try:
        return _CLIENT_EVENT.validate_python(raw)
    except ValidationError as err:
        raise _as_client_error(err, event_id) from None


def _as_client_error(err: ValidationError, event_id: str | None) -> ClientError:
    first = err.errors(include_url=False)[0]
    # loc starts with the union tag (the event type); the rest is the parameter path
    param = param_of(first["loc"][1:]) or None
    codes = {"extra_forbidden": ErrorCode.UNKNOWN_PARAMETER, "missing": ErrorCode.MISSING_PARAMETER}
    code = codes.get(first["type"], ErrorCode.INVALID_VALUE)
    return ClientError(code, f"{param or 'event'}: {first['msg']}", param, event_id=event_id)


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


class AudioFormatOut(BaseModel):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: int


class AudioInputOut(BaseModel):
    format: AudioFormatOut
    turn_detection: ServerVad | None = None


class AudioOut(BaseModel):
    input: AudioInputOut


class MetronomeSessionOut(BaseModel):
    mode: Literal["duplex", "turn"]
    frame_period_s: float
    deadline_s: float
    output_tokens_per_frame: int  # duplex: per frame; turn: per response
    policy: str
    token_rate_hz: float


class SessionOut(BaseModel):
    type: Literal["realtime"] = "realtime"
    object: Literal["realtime.session"] = "realtime.session"
    id: str
    model: str
    output_modalities: list[Literal["text"]] = ["text"]
    audio: AudioOut
    metronome: MetronomeSessionOut


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
    type: Literal["input_text", "input_audio", "output_text"]
    text: str | None = None
    transcript: str | None = None


class ItemOut(BaseModel):
    id: str
    object: Literal["realtime.item"] = "realtime.item"
    type: Literal["message"] = "message"
    role: Literal["user", "system", "assistant"]
    status: Literal["completed", "incomplete", "in_progress"] = "completed"
    content: list[ContentOut]


class ConversationItemAdded(ServerEvent):
    type: Literal["conversation.item.added"] = "conversation.item.added"
    previous_item_id: str | None = None
    item: ItemOut


class StatusDetails(BaseModel):
    type: Literal["completed", "cancelled", "incomplete", "failed"]
    reason: str | None = None  # `deadline` (answered at its deadline), `turn_detected`, ...
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
    output_modalities: list[Literal["text"]] = ["text"]
    output: list[ItemOut] = []
    usage: Usage | None = None


class ResponseCreated(ServerEvent):
    type: Literal["response.created"] = "response.created"
    response: ResponseOut


class ResponseOutputTextDelta(ServerEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    response_id: str
    item_id: str
    output_index: int = 0
    content_index: int = 0
    delta: str


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
