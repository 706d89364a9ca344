"""The Realtime API as OpenAI's own package defines it: every GA session field and client event
type parses; a default client gets OpenAI's events only, in OpenAI's order, each of which
parses strictly with the `openai` package's server-event types (`tests.conformance`, checked
in every `recv`); and every client event is either done or refused by name."""

from __future__ import annotations

import base64
import json
import typing

import pydantic
import pytest
from openai.types.realtime import RealtimeClientEvent
from openai.types.realtime.realtime_session_create_request import RealtimeSessionCreateRequest
from websockets.sync.client import connect

from metronome.serve import protocol as p
from metronome.serve.protocol import with_extensions
from metronome.serve.protocol.schema import SessionIn
from metronome.serve.realtime.session import UNSUPPORTED_EVENT_TYPES
from tests.served import recv, recv_until

# ---- the schema, without a server ----------------------------------------------------------
EVERY_GA_SESSION_FIELD = {
    "type": "realtime", "model": "gpt-realtime", "instructions": "Be brief.",
    "output_modalities": ["text"], "max_output_tokens": "inf",
    "audio": {
        "input": {"format": {"type": "audio/pcm", "rate": 24000},
                  "noise_reduction": {"type": "near_field"},
                  "transcription": {"model": "whisper-1", "language": "en", "prompt": "",
                                    "keywords": ["Paris"], "languages": ["en"],
                                    "delay": "low"},
                  "turn_detection": {"type": "server_vad", "threshold": 0.5,
                                     "prefix_padding_ms": 300, "silence_duration_ms": 500,
                                     "create_response": True, "interrupt_response": True,
                                     "idle_timeout_ms": None}},
        "output": {"format": {"type": "audio/pcm", "rate": 24000}, "speed": 1.0,
                   "voice": "alloy"}},
    "tools": [{"type": "function", "name": "get_weather", "description": "the weather",
               "parameters": {"type": "object", "properties": {}}}],
    "tool_choice": "auto", "parallel_tool_calls": False,
    "tracing": {"workflow_name": "w", "group_id": "g", "metadata": {"a": 1}},
    "truncation": {"type": "retention_ratio", "retention_ratio": 0.8,
                   "token_limits": {"post_instructions": 1000}},
    "prompt": {"id": "pmpt_1", "version": "1", "variables": {"city": "Paris"}},
    "include": ["item.input_audio_transcription.logprobs"],
    "reasoning": {"effort": "low"},
}


def _field_paths(model: type[pydantic.BaseModel], prefix: str = "", depth: int = 0) -> set[str]:
    """Every field path of a model, through nested models, unions and lists (3 levels)."""
    paths = set()
    for name, field in model.model_fields.items():
        path = prefix + name
        paths.add(path)
        if depth < 3:
            for nested in _models_in(field.annotation):
                paths |= _field_paths(nested, path + ".", depth + 1)
    return paths


def _models_in(annotation) -> list[type[pydantic.BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def test_the_session_schema_has_every_field_of_openais():
    ours, theirs = _field_paths(SessionIn), _field_paths(RealtimeSessionCreateRequest)
    # down to the parts we take as opaque JSON (tool parameters, MCP filters)
    missing = {path for path in theirs - ours
               if not path.startswith(("tools.", "prompt.variables"))}
    assert not missing, f"OpenAI's session has fields ours refuses: {sorted(missing)}"
    assert ours - theirs == {"metronome", "metronome.mode"}  # the extension, nothing else


def test_every_ga_session_field_parses_in_one_update():
    event = p.parse_client_event(json.dumps({"type": "session.update",
                                             "session": EVERY_GA_SESSION_FIELD}))
    assert set(event.session.model_fields_set) == set(EVERY_GA_SESSION_FIELD)
    assert "tools" in event.session.not_honored()


def test_a_field_outside_openais_schema_is_still_unknown():
    with pytest.raises(p.ClientError) as caught:
        p.parse_client_event('{"type": "session.update", "session": {"voice": "alloy"}}')
    assert (caught.value.code, caught.value.param) == (p.ErrorCode.UNKNOWN_PARAMETER,
                                                       "session.voice")


def test_every_ga_client_event_type_parses():
    theirs = {m.model_fields["type"].annotation.__args__[0]
              for m in typing.get_args(typing.get_args(RealtimeClientEvent)[0])}
    assert theirs == set(p.CLIENT_EVENT_TYPES)
    assert UNSUPPORTED_EVENT_TYPES < theirs


# ---- a server ---------------------------------------------------------------------------------
def send(ws, **event) -> None:
    ws.send(json.dumps(event))


def user_text(text: str, **extra) -> dict:
    return {"type": "conversation.item.create", **extra, "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}


def error_code(ws) -> str:
    event = recv(ws)
    assert event["type"] == "error", event
    return event["error"]["code"]


@pytest.mark.model
def test_a_text_turn_is_openais_events_in_openais_order(turn_server):
    with connect(turn_server.ws_url) as ws:
        created = recv(ws)
        assert "metronome" not in created["session"]  # no extension unless asked for
        ws.send(json.dumps(user_text("What is the capital of France?")))
        send(ws, type="response.create", response={"metadata": {"turn": "1"}})
        events = recv_until(ws, "response.done")
    types = [e["type"] for e in events]
    assert not any(t.startswith("metronome.") or t == "error" for t in types), types
    assert [t for t in types if t != "response.output_text.delta"] == [
        "conversation.item.added", "conversation.item.done",  # the user's item
        "response.created", "response.output_item.added", "conversation.item.added",
        "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done"]
    user_item, reply = events[0]["item"], events[-1]["response"]
    assistant_added = events[4]
    assert assistant_added["previous_item_id"] == user_item["id"]
    item_id = reply["output"][0]["id"]
    assert {e.get("item_id", e.get("item", {}).get("id")) for e in events[3:-1]} == {item_id}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done_text = next(e["text"] for e in events if e["type"] == "response.output_text.done")
    assert text == done_text == reply["output"][0]["content"][0]["text"] and "Paris" in text
    assert reply["status"] == "completed" and reply["metadata"] == {"turn": "1"}


@pytest.mark.model
def test_metronome_events_go_to_a_client_that_opted_in(turn_server):
    with connect(with_extensions(turn_server.ws_url)) as ws:
        assert recv(ws)["session"]["metronome"]["mode"] == "turn"
        ws.send(json.dumps(user_text("Hi")))  # context in a turn session: no frame
        send(ws, type="response.create")
        frame = recv_until(ws, "metronome.frame")[-1]["frame"]
    assert frame["kind"] == "response" and frame["status"] == "ok"


@pytest.mark.model
def test_ga_fields_not_served_are_accepted_and_shown_as_in_effect(turn_server):
    with connect(turn_server.ws_url) as ws:
        recv(ws)
        send(ws, type="session.update", session=EVERY_GA_SESSION_FIELD)
        events = recv_until(ws, "session.updated")
    session = events[-1]["session"]
    assert not [e for e in events if e["type"] == "error"]
    # instructions join the model's context, not the conversation's items (as OpenAI's)
    assert not [e for e in events if e["type"] == "conversation.item.added"]
    assert session["instructions"] == "Be brief."
    assert (session["tools"], session["tool_choice"], session["tracing"]) == ([], "none", None)
    assert session["output_modalities"] == ["text"]
    assert session["audio"]["input"]["transcription"] is None
    assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    assert session["max_output_tokens"] == "inf"  # honoured: the server's ceiling per reply


@pytest.mark.model
def test_response_cancel_ends_the_response_cancelled(turn_server):
    with connect(turn_server.ws_url) as ws:
        recv(ws)
        ws.send(json.dumps(user_text("Tell me a long story about a dragon.")))
        send(ws, type="response.create")
        send(ws, type="response.cancel", event_id="stop")
        done = recv_until(ws, "response.done")[-1]["response"]
        assert done["status"] == "cancelled"
        assert done["status_details"]["reason"] == "client_cancelled"
        send(ws, type="response.cancel", event_id="again")  # nothing in progress now
        assert error_code(ws) == "response_cancel_not_active"


@pytest.mark.model
def test_input_audio_buffer_clear_drops_the_uncommitted_audio(turn_server):
    pcm = b"\x00\x01" * 2400  # 0.1 s at 24 kHz
    with connect(turn_server.ws_url) as ws:
        recv(ws)
        send(ws, type="input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
        send(ws, type="input_audio_buffer.clear")
        assert recv(ws)["type"] == "input_audio_buffer.cleared"
        send(ws, type="input_audio_buffer.commit")
        assert error_code(ws) == "input_audio_buffer_commit_empty"


@pytest.mark.model
def test_items_are_retrieved_appended_at_the_end_and_refused_by_name(turn_server):
    with connect(turn_server.ws_url) as ws:
        recv(ws)
        ws.send(json.dumps(user_text("Hello", previous_item_id="root")))  # empty: the end
        first = recv_until(ws, "conversation.item.done")[-1]["item"]
        send(ws, type="conversation.item.retrieve", item_id=first["id"])
        retrieved = recv(ws)
        assert retrieved["type"] == "conversation.item.retrieved"
        assert retrieved["item"] == first
        send(ws, type="conversation.item.retrieve", item_id="item_nope")
        assert error_code(ws) == "item_not_found"
        ws.send(json.dumps(user_text("Again", previous_item_id=first["id"])))  # at the end
        second = recv_until(ws, "conversation.item.done")[-1]
        assert second["previous_item_id"] == first["id"]
        ws.send(json.dumps(user_text("Before", previous_item_id=first["id"])))  # the middle
        assert error_code(ws) == "unsupported"
        for event in ({"type": "conversation.item.delete", "item_id": first["id"]},
                      {"type": "output_audio_buffer.clear"}):
            ws.send(json.dumps(event))
            assert error_code(ws) == "unsupported", event
        ws.send(json.dumps({"type": "conversation.item.truncate", "item_id": first["id"],
                            "content_index": 0, "audio_end_ms": 0}))
        assert error_code(ws) == "invalid_value"  # a user item: only replies are truncated
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "function_call_output", "call_id": "c", "output": "{}"}}))
        assert error_code(ws) == "unsupported"
        send(ws, type="response.create", response={"conversation": "none"})
        assert error_code(ws) == "unsupported"


@pytest.mark.model
def test_response_instructions_and_assistant_items_join_the_context(turn_server):
    with connect(turn_server.ws_url) as ws:
        recv(ws)
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello! How can I help?"}]}}))
        recv_until(ws, "conversation.item.done")
        send(ws, type="response.create",
             response={"instructions": "Answer with one word: the capital of France."})
        events = recv_until(ws, "response.done")
    assert not [e for e in events if e["type"] == "conversation.item.added"
                and e["item"]["role"] == "system"]
    reply = events[-1]["response"]
    assert reply["status"] == "completed" and "Paris" in reply["output"][0]["content"][0]["text"]
