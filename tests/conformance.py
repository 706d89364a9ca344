"""OpenAI's own schema as the judge of every server event a test receives: parsed with the
`openai` package's server-event union, strictly (no coercion), and with no field the schema
does not have (its models accept extra fields; we do not send them). `metronome.*` events
are extensions, for clients that opted in, and are checked by the tests that ask for them."""

from __future__ import annotations

import json
import typing

from openai.types.realtime import RealtimeServerEvent
from pydantic import BaseModel

# the union's own discriminator is the SDK's, which pydantic does not see: dispatch on `type`
SERVER_EVENT_MODELS: dict[str, type[BaseModel]] = {
    model.model_fields["type"].annotation.__args__[0]: model
    for model in typing.get_args(typing.get_args(RealtimeServerEvent)[0])
}
# what OpenAI's own server sends in a session object and the SDK's model leaves out
_ALLOWED_EXTRA = {("session", "id"), ("session", "object")}


def check_server_event(event: dict, extensions: bool = False) -> None:
    """Raise `AssertionError` unless `event` is one of OpenAI's server events, exactly; with
    `extensions` (the client opted in), `metronome.*` events and the session's `metronome`
    block are allowed too."""
    if event["type"].startswith("metronome."):
        assert extensions, f"{event['type']} sent to a client that did not opt in"
        return
    if extensions and "metronome" in event.get("session", {}):
        event = {**event, "session": {k: v for k, v in event["session"].items()
                                      if k != "metronome"}}
    event = _at_openai_rate(event)
    model = SERVER_EVENT_MODELS.get(event["type"])
    assert model is not None, f"{event['type']} is not one of OpenAI's server events"
    parsed = model.model_validate(event, strict=True)
    extra = list(_extra_fields(parsed, ()))
    assert not extra, f"{event['type']}: fields outside OpenAI's schema: {extra}"


def _extra_fields(value, path: tuple[str, ...]):
    if isinstance(value, BaseModel):
        for name in value.model_extra or {}:
            if (path[-1:] + (name,)) not in _ALLOWED_EXTRA:
                yield ".".join(path + (name,))
        for name in type(value).model_fields:
            yield from _extra_fields(getattr(value, name), path + (name,))
    elif isinstance(value, list):
        for item in value:
            yield from _extra_fields(item, path)


def _at_openai_rate(event: dict) -> dict:
    """OpenAI's schema knows audio/pcm at 24 kHz only; a session the client set to another
    served rate (16 or 48 kHz, outside that schema, so only a client that knows it asks) is
    checked as if at 24 kHz."""
    audio_format = ((event.get("session") or {}).get("audio") or {}).get("input", {}).get(
        "format")
    if audio_format and audio_format.get("rate") != 24000:
        event = json.loads(json.dumps(event))
        event["session"]["audio"]["input"]["format"]["rate"] = 24000
    return event
