"""The server events of the Realtime API (GA) this server sends, typed, in OpenAI's shapes
(`tests/serve/test_serve_conformance.py` parses every one the server tests see with the
`openai` package's own server-event union, strictly), and the `metronome.frame` extension
(sent only to a client that opted in).

A response's events, in OpenAI's order: `response.created`, `response.output_item.added`,
`conversation.item.added`, `response.content_part.added`, then, when the beat answers its
frame, `response.output_text.delta` (if any text), `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`, `conversation.item.done`,
`response.done`. A user item: `conversation.item.added`, `conversation.item.done`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, model_serializer

from metronome.serve.protocol import ServerEvent
from metronome.serve.session_schema import SessionOut


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


class ConversationItemRetrieved(ServerEvent):
    type: Literal["conversation.item.retrieved"] = "conversation.item.retrieved"
    item: ItemOut


class InputAudioBufferCleared(ServerEvent):
    type: Literal["input_audio_buffer.cleared"] = "input_audio_buffer.cleared"


class StatusDetails(BaseModel):
    type: Literal["completed", "cancelled", "incomplete", "failed"]
    # cancelled: `turn_detected` (server VAD) or `client_cancelled` (response.cancel); a late
    # frame is `incomplete` with no reason of OpenAI's (its `metronome.frame` says "late")
    reason: Literal["turn_detected", "client_cancelled"] | None = None
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


class PartOut(BaseModel):
    type: Literal["text"] = "text"
    text: str = ""


class ResponseContentPartAdded(_ContentEvent):
    type: Literal["response.content_part.added"] = "response.content_part.added"
    part: PartOut


class ResponseContentPartDone(_ContentEvent):
    type: Literal["response.content_part.done"] = "response.content_part.done"
    part: PartOut


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
