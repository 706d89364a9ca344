"""The Realtime server on a background thread of the test process (real uvicorn, real
sockets, the bundled SmolLM2): the protocol flows, limits, admission, auth, and blocks
returning to the pool when clients are killed."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import sys
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from metronome.load.run import LoadConfig, run_load
from metronome.load.speech import SPEECH_DIR, speech_stream
from metronome.model.weights import load_tokenizer
from metronome.serve import connection
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import with_extensions
from metronome.serve.realtime.session import RealtimeSession
from metronome.serve.server import ServerThread
from tests.served import TEXT_DUPLEX, metric, recv, recv_until

pytestmark = pytest.mark.model
AUDIO_DIR = SPEECH_DIR
# Tests send two frames of audio at once: the second waits for the first, which on a 2-core
# CPU without native bf16 (fp32) took up to 950 ms of a 1 s deadline; 2 s keeps them honest.
SMALL = TEXT_DUPLEX | {"pool_tokens": 2048, "admission": "off", "deadline_fraction": 2.0}


def speech(seconds: float, rate_hz: int = 24000) -> bytes:
    return speech_stream(AUDIO_DIR, rate_hz, seconds)


def append(pcm: bytes) -> str:
    return json.dumps({"type": "input_audio_buffer.append",
                       "audio": base64.b64encode(pcm).decode()})


@pytest.fixture(scope="module")
def model(smollm2):
    return smollm2, load_tokenizer()


@pytest.fixture(scope="module")
def server(model):
    with ServerThread(ServerConfig(**SMALL), *model) as running:
        yield running


def test_duplex_streams_a_response_per_frame_without_commit(server):
    with connect(with_extensions(server.ws_url)) as ws:
        created = recv(ws)
        assert created["type"] == "session.created"
        assert created["session"]["audio"]["input"]["format"] == {"type": "audio/pcm",
                                                                 "rate": 24000}
        assert created["session"]["metronome"]["mode"] == "duplex"
        ws.send(append(speech(2.0)))
        events = recv_until(ws, "response.done", count=2)
    frames = [e["frame"] for e in events if e["type"] == "metronome.frame"]
    assert [f["audio_end_ms"] for f in frames] == [1000.0, 2000.0]
    assert all(f["status"] == "ok" and f["deadline_met"] and f["kind"] == "audio"
               for f in frames)
    done = [e["response"] for e in events if e["type"] == "response.done"]
    assert [r["status"] for r in done] == ["completed", "completed"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and {d["response_id"] for d in deltas} <= {r["id"] for r in done}
    for response in done:  # created before its delta, frame and done
        kinds = [e["type"] for e in events if response["id"] in (
            e.get("response_id"), e.get("response", {}).get("id"))]
        assert kinds[0] == "response.created" and kinds[-1] == "response.done"


def test_turn_mode_prefills_audio_and_replies_on_response_create(server):
    with connect(with_extensions(server.ws_url)) as ws:
        recv(ws)
        ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "c0"}))
        error = recv(ws)["error"]
        assert (error["code"], error["event_id"]) == ("input_audio_buffer_commit_empty", "c0")
        ws.send(json.dumps({"type": "session.update",
                            "session": {"metronome": {"mode": "turn"}}}))
        assert recv(ws)["session"]["metronome"]["mode"] == "turn"
        ws.send(append(speech(1.5)))
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        events = recv_until(ws, "metronome.frame", count=2)
        assert "response.created" not in [e["type"] for e in events]  # prefill only
        assert [e["frame"]["audio_end_ms"] for e in events
                if e["type"] == "metronome.frame"] == [1000.0, 1500.0]
        assert "input_audio_buffer.committed" in [e["type"] for e in events]
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "What is the capital of France?"}]}}))
        ws.send(json.dumps({"type": "response.create"}))
        ws.send(json.dumps({"type": "response.create", "event_id": "again"}))
        events = recv_until(ws, "response.done")
    second = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in second] == [
        ("conversation_already_has_active_response", "again")]
    reply = events[-1]["response"]
    assert reply["status"] == "completed"
    assert "Paris" in reply["output"][0]["content"][0]["text"]


def test_settings_lock_once_input_starts(server):
    with connect(with_extensions(server.ws_url)) as ws:
        recv(ws)
        ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 8000}}}}}))
        assert recv(ws)["error"]["code"] == "unsupported_sample_rate"
        ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}}}}}))
        assert recv(ws)["session"]["audio"]["input"]["format"]["rate"] == 16000
        ws.send(append(speech(1.0, rate_hz=16000)))
        frame = next(e for e in recv_until(ws, "response.done")
                     if e["type"] == "metronome.frame")["frame"]
        assert frame["audio_end_ms"] == 1000.0
        ws.send(json.dumps({"type": "session.update",
                            "session": {"metronome": {"mode": "turn"}}}))
        assert recv(ws)["error"]["code"] == "session_locked"


def test_audio_faster_than_real_time_is_refused_past_the_buffer(server):
    chunk = speech(1.0)
    with connect(with_extensions(server.ws_url)) as ws:
        recv(ws)
        for _ in range(8):  # 8 s of audio at once; the limit is 4 s unanswered
            ws.send(append(chunk))
        events, frames = [], 0
        while frames < 8 - sum(e["type"] == "error" for e in events):
            events.append(recv(ws))
            frames += events[-1]["type"] == "metronome.frame"
        errors = [e["error"]["code"] for e in events if e["type"] == "error"]
        assert errors and set(errors) == {"input_audio_buffer_overflow"}
        assert frames == 8 - len(errors) <= 4
        ws.send(append(chunk))  # everything answered: room again
        assert any(e["type"] == "metronome.frame" for e in recv_until(ws, "metronome.frame"))


def test_text_items_faster_than_they_are_answered_are_refused(server):
    item = json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})
    with connect(server.ws_url) as ws:
        recv(ws)
        for _ in range(8):  # each a frame; 4 s of frames may be unanswered
            ws.send(item)
        ws.send(json.dumps({"type": "session.update", "session": {}}))
        events = recv_until(ws, "session.updated")
    added = sum(e["type"] == "conversation.item.added" and e["item"]["role"] == "user"
                for e in events)  # (duplex answers each with a response: its item too)
    errors = [e["error"]["code"] for e in events if e["type"] == "error"]
    assert added + len(errors) == 8 and 1 <= added <= 4
    assert set(errors) == {"too_many_pending_frames"}


def test_healthz_metrics_and_sessions_list(server):
    with connect(server.ws_url) as ws:
        session_id = recv(ws)["session"]["id"]
        ws.send(append(speech(1.0)))
        recv_until(ws, "response.done")
        listed = httpx.get(server.url + "/v1/sessions").json()["data"]
        mine = next(s for s in listed if s["id"] == session_id)
        assert mine["status"] == "active" and mine["resident_kv_tokens"] > 0
        assert mine["frames_answered"] == 1
    health = httpx.get(server.url + "/healthz").json()
    assert health["stall_detector"]["state"] in ("ok", "degraded", "critical")
    verdicts = ["ok", "degraded", "critical"]  # the status is the worse of the two verdicts
    assert health["status"] == max(health["stall_detector"]["state"],
                                   health["overload"]["state"], key=verdicts.index)
    assert metric(server, "metronome_frames_total", status="ok") >= 1


def test_the_health_listener_serves_probes_only_and_readyz_says_draining(server):
    probes = server.health_url
    assert probes != server.url
    assert httpx.get(probes + "/healthz").json()["status"] in ("ok", "degraded", "critical")
    assert httpx.get(probes + "/readyz").json() == {"status": "ready"}
    assert httpx.get(server.url + "/readyz").status_code == 200  # the client port too
    assert "metronome_door_connections" in httpx.get(probes + "/metrics").text
    other = httpx.get(probes + "/v1/sessions")
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
    with pytest.raises(Exception):  # noqa: B017 - refused before the upgrade
        connect(probes.replace("http", "ws", 1) + "/v1/realtime", open_timeout=5)
    door = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
            if line.startswith("metronome_door_connections{")]
    assert any('listener="health"' in line for line in door), door


def test_readyz_is_503_while_draining(model):
    with ServerThread(ServerConfig(**SMALL), *model) as draining:
        serving = draining.app.state.serving
        serving.driver.loop.call_soon_threadsafe(serving.drain, 60.0)  # on its loop
        time.sleep(0.2)
        ready = httpx.get(draining.health_url + "/readyz")
        assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
        assert httpx.get(draining.health_url + "/healthz").status_code == 200  # alive


def test_message_size_binary_and_transport_cap():
    config = ServerConfig(**SMALL, max_message_bytes=16384)  # transport cap: 64 KiB
    with ServerThread(config) as limited, connect(limited.ws_url) as ws:
        recv(ws)
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 20000}))
        assert recv(ws)["error"]["code"] == "message_too_large"
        ws.send(b"\x00\x01")
        assert recv(ws)["error"]["code"] == "binary_not_supported"
        ws.send("x" * 70000)
        with pytest.raises(ConnectionClosed) as closed:
            recv(ws)
        assert closed.value.rcvd.code == 1009


def test_idle_timeout_and_max_session_duration(model):
    idle = ServerConfig(**SMALL, idle_timeout_s=0.5)
    with ServerThread(idle, *model) as server, connect(server.ws_url) as ws:
        recv(ws)
        assert recv(ws)["error"]["code"] == "idle_timeout"
        with pytest.raises(ConnectionClosed) as closed:
            recv(ws)
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1000, "idle timeout")
    short = ServerConfig(**SMALL, max_session_s=1.0)
    with ServerThread(short, *model) as server, connect(server.ws_url) as ws:
        recv(ws)
        started = time.monotonic()
        with contextlib.suppress(ConnectionClosed):  # busy, never idle, until it expires
            while True:
                ws.send(json.dumps({"type": "session.update", "session": {}}))
                time.sleep(0.1)
        events = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                events.append(recv(ws))
        assert events[-1]["error"]["code"] == "session_expired"
        assert closed.value.rcvd.code == 1000 and 0.5 <= time.monotonic() - started < 2.5


def test_admission_refuses_before_the_upgrade_with_retry_after(model):
    config = ServerConfig(**TEXT_DUPLEX, pool_tokens=2048, admission="static", admission_cap=1)
    with ServerThread(config, *model) as server:
        with connect(server.ws_url) as first:
            recv(first)
            with pytest.raises(InvalidStatus) as refused:
                connect(server.ws_url)
            response = refused.value.response
            assert response.status_code == 503
            assert response.headers["Retry-After"] == "2"
            assert json.loads(response.body)["error"]["code"] == "server_at_capacity"
        deadline = time.monotonic() + 2
        while httpx.get(server.url + "/healthz").json()["sessions"] and (
                time.monotonic() < deadline):
            time.sleep(0.02)
        with connect(server.ws_url) as again:
            assert recv(again)["type"] == "session.created"
        assert metric(server, "metronome_sessions_total", outcome="refused_at_capacity") == 1
        assert metric(server, "metronome_admission_decisions_total",
                      decision="refused_at_capacity") == 1
        assert metric(server, "metronome_admission_decisions_total", decision="admitted") >= 1


def test_api_key_guards_everything_but_healthz(model):
    config = ServerConfig(**SMALL, api_key="sekrit")
    good = {"Authorization": "Bearer sekrit"}
    with ServerThread(config, *model) as server:
        assert httpx.get(server.url + "/healthz").status_code == 200
        for path in ("/metrics", "/v1/sessions"):
            denied = httpx.get(server.url + path, headers={"Authorization": "Bearer nope"})
            assert denied.status_code == 401
            assert denied.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(server.url + path, headers=good).status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}):
            with pytest.raises(InvalidStatus) as refused:  # before the upgrade
                connect(server.ws_url, additional_headers=headers)
            assert refused.value.response.status_code == 401
        with connect(server.ws_url, additional_headers=good) as ws:
            assert recv(ws)["type"] == "session.created"


def test_without_api_key_everything_is_open(server):
    for path in ("/healthz", "/metrics", "/v1/sessions"):
        assert httpx.get(server.url + path).status_code == 200


CLIENT = """
import base64, json, sys, time
from websockets.sync.client import connect
ws = connect(sys.argv[1])
json.loads(ws.recv())
pcm = bytes(range(256)) * 375  # 2 s of 24 kHz PCM16
ws.send(json.dumps({"type": "input_audio_buffer.append",
                    "audio": base64.b64encode(pcm).decode()}))
print("sent", flush=True)
time.sleep(120)
"""


def test_killed_clients_return_their_blocks_within_one_second(model):
    with ServerThread(ServerConfig(**SMALL), *model) as server:
        clients = [subprocess.Popen([sys.executable, "-c", CLIENT, server.ws_url],
                                    stdout=subprocess.PIPE, text=True) for _ in range(3)]
        try:
            assert all(c.stdout.readline().strip() == "sent" for c in clients)
            deadline = time.monotonic() + 30
            while not _all_answered(server, sessions=3, frames=2):
                assert time.monotonic() < deadline, "frames never answered"
                time.sleep(0.05)
            assert metric(server, "metronome_kv_pool_blocks", state="used") > 0
        finally:
            for client in clients:
                client.kill()
        killed = time.monotonic()
        while metric(server, "metronome_kv_pool_blocks", state="used") > 0:
            assert time.monotonic() - killed < 1.0, "blocks not back within 1 s"
            time.sleep(0.01)
        assert metric(server, "metronome_sessions_total", outcome="disconnected") == 3
        assert httpx.get(server.url + "/v1/sessions").json()["data"] == []
        for client in clients:
            client.wait()


def _all_answered(server: ServerThread, sessions: int, frames: int) -> bool:
    listed = httpx.get(server.url + "/v1/sessions").json()["data"]
    return len(listed) == sessions and all(s["frames_answered"] >= frames for s in listed)


def test_load_generator_records_refusals(model, tmp_path):
    config = ServerConfig(**TEXT_DUPLEX, pool_tokens=2048, admission="static", admission_cap=1)
    with ServerThread(config, *model) as server:
        load = LoadConfig(url=server.ws_url, sessions=2, ramp_s=0.2, duration_s=2.0,
                          out=str(tmp_path))
        summary = asyncio.run(run_load(load))
    assert summary["sessions"] == {"started": 2, "finished": 2, "completed": 1, "refused": 1}
    assert summary["retry_after_s"] == [2.0] and summary["frames"] == 2


def test_a_client_that_does_not_read_is_closed_alone(model):
    unlimited = {"rate_limit_messages_per_s": 1e9}  # the rate limit would close it first
    with ServerThread(ServerConfig(**SMALL, max_outbox_events=16, **unlimited), *model) as server:
        with connect(server.ws_url) as reader:
            recv(reader)
            slow = connect(server.ws_url, max_queue=1)  # stops reading its socket at once
            sent = 0
            while httpx.get(server.url + "/healthz").json()["sessions"] == 2:
                assert sent < 200_000, "the slow reader was never closed"
                for _ in range(500):  # each answered by an error it never reads
                    slow.send("{}")
                sent += 500
            assert metric(server, "metronome_sessions_total", outcome="slow_consumer") == 1
            reader.send("{}")
            assert recv(reader)["error"]["code"] == "unknown_event_type"
            slow.socket.close()


def test_a_failing_session_is_closed_1011_and_the_others_live_on(model, monkeypatch):
    doomed: set[str] = set()
    text_of = RealtimeSession.text_of

    def failing(session, token_ids, flush):
        if session.id in doomed:
            raise RuntimeError("injected failure")
        return text_of(session, token_ids, flush)

    monkeypatch.setattr(RealtimeSession, "text_of", failing)
    with ServerThread(ServerConfig(**SMALL), *model) as server:
        with connect(server.ws_url) as bad, connect(server.ws_url) as good:
            doomed.add(recv(bad)["session"]["id"])
            recv(good)
            bad.send(append(speech(1.0)))
            good.send(append(speech(1.0)))
            with pytest.raises(ConnectionClosed) as closed:
                recv_until(bad, "response.done")
            assert closed.value.rcvd.code == 1011
            done = recv_until(good, "response.done")[-1]
            assert done["response"]["status"] == "completed"
        assert metric(server, "metronome_sessions_total", outcome="error") == 1


def test_refusal_after_the_upgrade_is_an_error_then_close_1013(model, monkeypatch):
    monkeypatch.setattr(connection, "DENIAL_EXTENSION", "absent.extension")
    config = ServerConfig(**TEXT_DUPLEX, pool_tokens=2048, admission="static", admission_cap=1)
    with ServerThread(config, *model) as server, connect(server.ws_url) as first:
        recv(first)
        with connect(server.ws_url) as refused:
            assert recv(refused)["error"]["code"] == "server_at_capacity"
            started_s = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                recv(refused)
            assert closed.value.rcvd.code == 1013
            # the closing handshake completes at once: the server parses the client's close
            # reply instead of waiting out uvicorn's 10 s close timer (this once raced the
            # client's own 10 s timeout)
            assert time.monotonic() - started_s < 3.0
