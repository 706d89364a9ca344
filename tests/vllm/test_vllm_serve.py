"""`metronome serve --engine vllm`: the Realtime server, admission and health on vLLM.

One server subprocess (vLLM in-process there, ~30 s to start): a text turn gets a complete
reply, audio is refused with a clear error (vLLM's streaming input takes token ids only),
and admission's memory ceiling is vLLM's own per-request reservation of the bound.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                    reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

import httpx  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from metronome.serve.config import ServerConfig  # noqa: E402
from tests.served import TEXT_SERVER, served  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.wall_clock]

POOL_TOKENS, BOUND = 2048, "sinks_window:4:64"
# vLLM's reservation per bounded request, blocks of 32: 1 sink block + the window's
# ceil((64 - 1 + 256 in flight) / 32) + 1 = 12 blocks; a pool of 64 blocks holds 5
EXPECTED_CEILING = 64 // 12


def recv(ws, timeout_s: float = 60.0) -> dict:
    return json.loads(ws.recv(timeout=timeout_s))


def text_turn(ws, text: str) -> list[dict]:
    """A user text item and a response: the events up to `response.done`."""
    ws.send(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
    ws.send(json.dumps({"type": "response.create"}))
    events = []
    while not events or events[-1]["type"] != "response.done":
        events.append(recv(ws))
    return events


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(**(TEXT_SERVER | {"max_response_tokens": 8}),
                          engine="vllm", vllm_mode="eager", pool_tokens=POOL_TOKENS, policy=BOUND,
                          mode="turn",
                          deadline_fraction=3.0)
    with served(config) as url:
        yield url


def test_a_text_turn_gets_a_complete_reply(server):
    with connect(server.replace("http", "ws") + "/v1/realtime") as ws:
        assert recv(ws)["type"] == "session.created"
        events = text_turn(ws, "What is the capital of France?")
        done = events[-1]["response"]
        assert done["status"] == "completed", done
        text = "".join(e.get("delta", "") for e in events
                       if e["type"] in ("response.output_text.delta", "response.text.delta"))
        assert text.strip(), [e["type"] for e in events]


def test_audio_is_refused_with_a_clear_error_and_the_session_lives_on(server):
    with connect(server.replace("http", "ws") + "/v1/realtime") as ws:
        recv(ws)
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"}))
        error = recv(ws)
        assert error["type"] == "error"
        assert error["error"]["code"] == "audio_input_unsupported"
        assert "text" in error["error"]["message"]
        ws.send(json.dumps({"type": "session.update", "session": {}}))
        assert recv(ws)["type"] == "session.updated"


def test_health_and_admission_read_vllms_pool(server):
    health = httpx.get(server + "/healthz").json()
    assert health["status"] == "ok"
    assert health["admission"]["memory_ceiling"] == EXPECTED_CEILING
    sessions = httpx.get(server + "/v1/sessions").json()
    assert sessions["kv_pool"]["num_blocks"] == POOL_TOKENS // 32
    assert sessions["kv_pool"]["block_size"] == 32


def test_a_per_session_bound_and_truncate_are_refused_by_name(server):
    """vLLM's plugin serves one bound per engine and a streaming request only grows its KV."""
    with connect(server.replace("http", "ws") + "/v1/realtime") as ws:
        recv(ws)
        ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "truncation": {"type": "retention_ratio",
                                               "retention_ratio": 0.5}}}))
        error = recv(ws)["error"]
        assert error["code"] == "unsupported" and "one bound" in error["message"]
        ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "truncation": "auto", "instructions": "You are Tobias."}}))
        assert recv(ws)["session"]["truncation"] == "auto"
        events = text_turn(ws, "Hello")
        item = events[-1]["response"]["output"][0]
        ws.send(json.dumps({"type": "conversation.item.truncate", "item_id": item["id"],
                            "content_index": 0, "audio_end_ms": 0}))
        error = recv(ws)["error"]
        assert error["code"] == "unsupported" and "cannot rewind" in error["message"]
