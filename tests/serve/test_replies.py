"""Replies of any length (issue 51): a turn's reply runs to the model's stop or its budget
(`max_output_tokens`, on `session.update` and on `response.create`, within the server's
`--max-response-tokens`), never to a deadline; its text streams as it is written, and a
reader it falls behind has gaps, counted, while the reply still completes."""

from __future__ import annotations

import json

import pytest
from websockets.sync.client import connect

from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import EXTENSIONS_QUERY
from metronome.serve.server import ServerThread
from tests.served import TEXT_SERVER, metric, recv, recv_until

pytestmark = pytest.mark.model


def send(ws, **event) -> None:
    ws.send(json.dumps(event))


def reply_to(ws, question: str, timeout_s: float = 120.0, **response) -> list[dict]:
    send(ws, type="conversation.item.create", item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]})
    recv_until(ws, "conversation.item.done")
    send(ws, type="response.create", **({"response": response} if response else {}))
    return recv_until(ws, "response.done", timeout_s=timeout_s)


def usage(events: list[dict]) -> tuple[str, str | None, int]:
    done = events[-1]["response"]
    return done["status"], done["status_details"]["reason"], done["usage"]["output_tokens"]


@pytest.fixture(scope="module")
def server(smollm2):
    """No reply ceiling but the default one (`--max-response-tokens`, 256)."""
    config = ServerConfig(**(TEXT_SERVER | {"max_response_tokens": 256}), mode="turn",
                          pool_tokens=8192, admission="off")
    with ServerThread(config, smollm2, load_tokenizer()) as running:
        yield running


def test_a_reply_asked_for_at_length_runs_far_past_the_old_16_tokens(server):
    with connect(server.ws_url + f"?{EXTENSIONS_QUERY}=true") as ws:
        recv(ws)
        events = reply_to(ws, "Write a long story about a dragon who learns to fly.")
    status, reason, tokens = usage(events)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    text = next(e["text"] for e in events if e["type"] == "response.output_text.done")
    assert tokens > 64 and status in ("completed", "incomplete"), (status, tokens)
    assert reason == ("max_output_tokens" if status == "incomplete" else None)
    assert len(deltas) > 8 and "".join(deltas) == text  # streamed as written
    [frame] = [e["frame"] for e in events if e["type"] == "metronome.frame"]
    assert frame["status"] == "ok" and frame["finish_s"] > frame["deadline_at_s"] or tokens < 256
    [paced] = [e["reply"] for e in events if e["type"] == "metronome.reply"]
    assert paced["output_tokens"] == tokens and paced["first_output_ms"] is not None


def test_max_output_tokens_on_the_session_and_on_one_response(server):
    with connect(server.ws_url) as ws:
        assert recv(ws)["session"]["max_output_tokens"] == "inf"
        send(ws, type="session.update", session={"type": "realtime", "max_output_tokens": 5})
        assert recv(ws)["session"]["max_output_tokens"] == 5
        story = "Write a long story about a dragon."
        assert usage(reply_to(ws, story)) == ("incomplete", "max_output_tokens", 5)
        assert usage(reply_to(ws, story, max_output_tokens=3)) == (
            "incomplete", "max_output_tokens", 3)
        assert usage(reply_to(ws, story))[2] == 5  # one response's budget was its own
        send(ws, type="session.update", session={"type": "realtime", "max_output_tokens": 0})
        error = recv(ws)
        assert error["type"] == "error" and error["error"]["code"] == "invalid_value"
        assert error["error"]["param"] == "session.max_output_tokens"
        send(ws, type="response.create", response={"max_output_tokens": 5000})
        error = recv(ws)
        assert error["error"]["param"] == "response.max_output_tokens"
        send(ws, type="session.update", session={"type": "realtime", "max_output_tokens": "inf"})
        assert recv(ws)["session"]["max_output_tokens"] == "inf"


def test_a_reader_faster_than_the_engine_hears_gaps_counted_and_the_reply_completes(smollm2):
    """A reading pace no engine keeps up with (10,000 tokens/s): every step's tokens come
    after the last ones were read, so the reply has gaps; they are counted, told and
    exported, and the reply still runs to its budget (a deadline would have cut it)."""
    config = ServerConfig(**(TEXT_SERVER | {"max_response_tokens": 40}), mode="turn",
                          pool_tokens=4096, admission="off", text_pace_tokens_per_s=10000.0)
    with ServerThread(config, smollm2, load_tokenizer()) as server:
        with connect(server.ws_url + f"?{EXTENSIONS_QUERY}=true") as ws:
            recv(ws)
            events = reply_to(ws, "Write a long story about a dragon.")
        status, _, tokens = usage(events)
        [paced] = [e["reply"] for e in events if e["type"] == "metronome.reply"]
        assert tokens == 40 or status == "completed"
        assert paced["gap_count"] > 0 and paced["gap_ms"] > 0 and paced["max_gap_ms"] > 0
        assert paced["pace_tokens_per_s"] == 10000.0
        assert metric(server, "metronome_reply_gaps_total", output="text") == paced["gap_count"]
        assert metric(server, "metronome_replies_total", output="text", gaps="yes") == 1
