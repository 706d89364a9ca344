"""The server's limits on one session, end to end (real uvicorn, the bundled SmolLM2): a text
item over the session's queued-input bound is refused with the numbers before anything is
accepted, and health and metrics report the memory ceiling beside the admission cap."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.sync.client import connect

from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import with_extensions
from metronome.serve.server import ServerThread
from tests.served import metric, recv, recv_until

pytestmark = pytest.mark.model


def item(text: str) -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})


def test_text_over_the_queued_input_bound_is_refused_and_health_shows_the_ceiling(smollm2):
    config = ServerConfig(pool_tokens=2048, admission="aimd", max_queued_input_tokens=64,
                          mode="turn")
    with ServerThread(config, smollm2, load_tokenizer()) as server:
        with connect(with_extensions(server.ws_url)) as ws:
            recv(ws)
            ws.send(item("the quick brown fox jumps over the lazy dog " * 20))
            error = recv(ws)["error"]
            assert error["code"] == "too_many_pending_frames"
            assert error["message"].startswith("text item of ")
            assert "(limit 64); it alone exceeds the limit" in error["message"]
            ws.send(item("Hello"))  # nothing was accepted: a small item still fits
            assert recv_until(ws, "metronome.frame")[-1]["frame"]["status"] == "ok"
        health = httpx.get(server.url + "/healthz").json()
        assert metric(server, "metronome_admission_memory_ceiling") == 3
    # 128 blocks; a sinks_window:4:512 session peaks at 38 (34 + a 64-token chunk)
    assert health["admission"]["memory_ceiling"] == 3
    assert health["admission"]["effective_cap"] == 3  # AIMD starts at 4
    assert health["stall_detector"]["state"] == "ok"  # refused input is no KV stall


def test_degrade_policy_bounds_a_session_at_the_wall_and_tells_its_client(smollm2):
    config = ServerConfig(policy="unbounded", degrade_policy="sinks_window:4:64",
                          pool_tokens=512, admission="off", mode="turn")
    long_text = "the quick brown fox jumps over the lazy dog " * 30  # ~300 tokens
    with ServerThread(config, smollm2, load_tokenizer()) as server:
        url = with_extensions(server.ws_url)
        with connect(url) as first, connect(url) as second:
            first_id = recv(first)["session"]["id"]
            recv(second)
            first.send(item(long_text))  # ~19 of the pool's 32 blocks
            recv_until(first, "metronome.frame")  # ok, or late on a busy machine
            second.send(item(long_text))  # the pool runs dry: the larger session is bound
            recv_until(second, "metronome.frame")
            bounded = recv_until(first, "metronome.session.bounded")[-1]
            assert bounded["type"] == "metronome.session.bounded"
            assert bounded["session_id"] == first_id
            assert bounded["bound"]["policy"] == "sinks_window:4:64@absolute"
            assert bounded["bound"]["reason"] == "kv_pressure"
            assert bounded["bound"]["freed_blocks"] > 0
            listed = {s["id"]: s for s in httpx.get(server.url + "/v1/sessions").json()["data"]}
            assert listed[first_id]["policy"] == "sinks_window:4:64@absolute"
            health = httpx.get(server.url + "/healthz").json()
            assert metric(server, "metronome_kv_pressure_bounded_sessions_total") == 1
    assert health["admission"]["memory_ceiling"] == 32 // 10  # sized by the degrade bound
