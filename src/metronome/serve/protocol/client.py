"""Client events of OpenAI's Realtime API (GA), typed and parsed.

Client events are parsed into a discriminated union on `type`; unknown parameters are
refused (as OpenAI does), so a client never believes a setting took effect when it did not.
Every client event type of the GA API parses; what the server cannot do with one is refused
by name with `ErrorCode.UNSUPPORTED` and the reason (the session's `handle` says which).
A message is read as JSON at a cost bounded by its size (`protocol.bounded_json`): too many
values, too deep, or a lone surrogate in a string is `invalid_json`, before validation.
The session object `session.update` carries is `protocol.schema`. Extensions, namespaced:
`session.metronome` (mode) and the `metronome.*` events, sent only to a client that opted
in (`?metronome_events=true` on the URL).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, get_args
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import Field, JsonValue, StrictInt, TypeAdapter, ValidationError

from metronome.serve.protocol.bounded_json import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_VALUES,
    JsonRefused,
    loads_bounded,
    param_of,
)
from metronome.serve.protocol.errors import ClientError, ErrorCode
from metronome.serve.protocol.schema import (
    MAX_ID_CHARS,
    ClientId,
    SessionIn,
    Strict,
    Tool,
    ToolChoice,
)

EXTENSIONS_QUERY = "metronome_events"  # ?metronome_events=true: `metronome.*` events too


def with_extensions(url: str) -> str:
    """`url` with the opt-in to `metronome.*` events (what the project's own clients use)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query)) | {EXTENSIONS_QUERY: "true"}
    return urlunsplit(parts._replace(query=urlencode(query)))


# ---- client events ------------------------------------------------------------------------
class _Event(Strict):
    """Every client event: its `type` (each its own) and the client's optional id."""

    event_id: ClientId | None = None


class _ItemEvent(_Event):
    item_id: ClientId


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionIn


class InputAudioBufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str  # base64 of PCM16 samples in the session's input format


class InputAudioBufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class InputAudioBufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class OutputAudioBufferClear(_Event):
    type: Literal["output_audio_buffer.clear"]


class ContentIn(Strict):
    """One content part of an item: `input_text` (user, system) and `output_text`
    (assistant) are served; audio and image parts parse, and are refused by name."""

    type: Literal["input_text", "input_audio", "input_image", "output_text", "output_audio"]
    text: str | None = None
    audio: str | None = None
    transcript: str | None = None
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class _ItemIn(Strict):
    """What every conversation item carries beside its `type`."""

    id: ClientId | None = None
    object: Literal["realtime.item"] | None = None
    status: Literal["completed", "incomplete", "in_progress"] | None = None


class MessageItemIn(_ItemIn):
    type: Literal["message"]
    role: Literal["user", "system", "assistant"]
    content: list[ContentIn] = Field(min_length=1, max_length=64)


class FunctionCallItemIn(_ItemIn):
    """Parsed so that it is refused by name: the served models call no tools."""

    type: Literal["function_call", "function_call_output"]
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


ItemIn = Annotated[MessageItemIn | FunctionCallItemIn, Field(discriminator="type")]


class ConversationItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: ClientId | None = None  # null or the last item: append (served)
    item: ItemIn


class ConversationItemRetrieve(_ItemEvent):
    type: Literal["conversation.item.retrieve"]


class ConversationItemDelete(_ItemEvent):
    type: Literal["conversation.item.delete"]


class ConversationItemTruncate(_ItemEvent):
    type: Literal["conversation.item.truncate"]
    content_index: StrictInt = Field(ge=0)
    audio_end_ms: StrictInt = Field(ge=0)


class ResponseAudioOutputIn(Strict):
    output: JsonValue = None  # format and voice: no audio is produced


class ResponseParamsIn(Strict):
    """`response.create`'s `response`: `instructions` is served (a system message just before
    the reply), and `max_output_tokens` (this reply's budget), the rest is accepted and not
    acted on, except an out-of-band response
    (`conversation: "none"` or `input`), refused by name."""

    instructions: str | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    conversation: Literal["auto", "none"] | ClientId | None = None
    input: list[JsonValue] | None = None
    audio: ResponseAudioOutputIn | None = None
    max_output_tokens: StrictInt | Literal["inf"] | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    prompt: JsonValue = None
    reasoning: JsonValue = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseParamsIn | None = None


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: ClientId | None = None  # absent: the response in progress


ClientEvent = Annotated[
    SessionUpdate | InputAudioBufferAppend | InputAudioBufferCommit | InputAudioBufferClear
    | OutputAudioBufferClear | ConversationItemCreate | ConversationItemRetrieve
    | ConversationItemDelete | ConversationItemTruncate | ResponseCreate | ResponseCancel,
    Field(discriminator="type")]
_CLIENT_EVENTS: tuple[type[_Event], ...] = get_args(get_args(ClientEvent)[0])
_CLIENT_EVENT: TypeAdapter[ClientEvent] = TypeAdapter(ClientEvent)
CLIENT_EVENT_TYPES = frozenset(get_args(m.model_fields["type"].annotation)[0]
                               for m in _CLIENT_EVENTS)


def parse_client_event(text: str, max_values: int = DEFAULT_MAX_VALUES,
                       max_depth: int = DEFAULT_MAX_DEPTH) -> ClientEvent:
    """One text message -> a typed event, or `ClientError` saying exactly what is wrong (with
    the event's `event_id` when it could be read). The work is bounded by the text's size
    and the two limits, whatever the message holds."""
    try:
        raw = loads_bounded(text, max_values, max_depth)
    except JsonRefused as err:
        event_id = _event_id_of(err.parsed) if err.parsed is not None else (
            readable_event_id(text))
        raise ClientError(ErrorCode.INVALID_JSON, str(err), err.param,
                          event_id=event_id) from None
    if not isinstance(raw, dict):
        raise ClientError(ErrorCode.INVALID_JSON, "an event must be a JSON object")
    event_id = _event_id_of(raw)
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


# The top-level object's leading members, while each is a plain string (no escapes): how an
# event_id is read from a message that is not parsed (over a bound, not JSON, over the rate).
# Each match is bounded, and so is their number: the cost never grows with the message.
_OBJECT_START = re.compile(r"\s*\{")
_STRING_MEMBER = re.compile(
    rf'\s*"([^"\\]{{1,32}})"\s*:\s*"([^"\\]{{0,{MAX_ID_CHARS}}})"\s*([,}}])')
_MAX_LEADING_MEMBERS = 4  # events lead with `type` and `event_id`


def readable_event_id(text: str) -> str | None:
    """A message's `event_id` without parsing it, when it is among the top-level object's
    first few members and those are plain strings (as clients write events); else None."""
    start = _OBJECT_START.match(text)
    position = 0 if start is None else start.end()
    for _ in range(_MAX_LEADING_MEMBERS if start is not None else 0):
        member = _STRING_MEMBER.match(text, position)
        if member is None:
            return None
        if member.group(1) == "event_id":
            return member.group(2)
        if member.group(3) == "}":
            return None
        position = member.end()
    return None


def _event_id_of(raw: object) -> str | None:
    """The client's `event_id` of a parsed message, if it is one an error can echo."""
    event_id = raw.get("event_id") if isinstance(raw, dict) else None
    if not isinstance(event_id, str) or len(event_id) > MAX_ID_CHARS:
        return None
    return None if _LONE_SURROGATE.search(event_id) else event_id


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_UNION_TAGS = frozenset({"message", "function_call", "function_call_output", "server_vad",
                         "semantic_vad"})


def _is_union_member(part) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or not part.islower()
                                      or "[" in part)


def _as_client_error(err: ValidationError, event_id: str | None) -> ClientError:
    first = err.errors(include_url=False)[0]
    # loc starts with the union tag (the event type); the rest is the parameter path, less
    # the tags and member names of the unions inside (an item's type, a turn detection's)
    param = param_of([part for part in first["loc"][1:] if not _is_union_member(part)]) or None
    codes = {"extra_forbidden": ErrorCode.UNKNOWN_PARAMETER, "missing": ErrorCode.MISSING_PARAMETER,
             "union_tag_not_found": ErrorCode.MISSING_PARAMETER}
    code = codes.get(first["type"], ErrorCode.INVALID_VALUE)
    if first["type"] in ("union_tag_not_found", "union_tag_invalid"):  # an inner union's `type`
        param = f"{param}.type" if param else "type"
    return ClientError(code, f"{param or 'event'}: {first['msg']}", param, event_id=event_id)


