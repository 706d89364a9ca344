"""The server's limits on one session, end to end (real uvicorn, the bundled SmolLM2): a text
item over the session's queued-input bound is refused with the numbers before anything is
accepted (and before it is tokenized: the worst messages cost the event loop < 1 ms each),
and health and metrics report the memory ceiling beside the admission cap."""

from __future__ import annotations

import gc
import json
import random
import statistics
import time

import httpx
import pytest
from websockets.sync.client import connect

from metronome.engine.engine import blocks_per_session
from metronome.kv.residency import ResidencyPolicy
from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.connection import Connection
from metronome.serve.protocol import with_extensions
from metronome.serve.realtime.intake import Intake
from metronome.serve.server import ServerThread
from tests.host_speed import host_slowness, printable
from tests.served import TEXT_SERVER, context_in, metric, recv, recv_until

pytestmark = pytest.mark.model


def item(text: str) -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})


def test_text_over_the_queued_input_bound_is_refused_and_health_shows_the_ceiling(smollm2):
    config = ServerConfig(**TEXT_SERVER,
                          pool_tokens=2048, admission="aimd", max_queued_input_tokens=64,
                          mode="turn")
    with ServerThread(config, smollm2, load_tokenizer()) as server:
        with connect(with_extensions(server.ws_url)) as ws:
            recv(ws)
            ws.send(item("the quick brown fox jumps over the lazy dog " * 20))
            error = recv(ws)["error"]
            assert error["code"] == "too_many_pending_frames"
            assert error["message"].startswith("text item of ")
            assert "(limit 64); it alone may exceed the limit" in error["message"]
            ws.send(item("Hello"))  # nothing was accepted: a small item still fits
            events = recv_until(ws, "conversation.item.done")
            assert not [e for e in events if e["type"] == "error"], events
        health = httpx.get(server.url + "/healthz").json()
        assert metric(server, "metronome_admission_memory_ceiling") == 3
    # 128 blocks; a sinks_window:4:512 session peaks at 38 (34 + a 64-token chunk)
    assert health["admission"]["memory_ceiling"] == 3
    assert health["admission"]["effective_cap"] == 3  # AIMD starts at 4
    assert health["stall_detector"]["state"] == "ok"  # refused input is no KV stall


def test_degrade_policy_bounds_a_session_at_the_wall_and_tells_its_client(smollm2):
    config = ServerConfig(**TEXT_SERVER, policy="unbounded", degrade_policy="sinks_window:4:64",
                          pool_tokens=512, admission="off", mode="turn")
    long_text = "the quick brown fox jumps over the lazy dog " * 30  # ~300 tokens
    with ServerThread(config, smollm2, load_tokenizer()) as server:
        url = with_extensions(server.ws_url)
        with connect(url) as first, connect(url) as second:
            first_id = recv(first)["session"]["id"]
            second_id = recv(second)["session"]["id"]
            first.send(item(long_text))  # ~19 of the pool's 32 blocks
            recv_until(first, "conversation.item.done")
            context_in(server, first_id)
            second.send(item(long_text))  # the pool runs dry: the larger session is bound
            recv_until(second, "conversation.item.done")
            context_in(server, second_id)
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
    # sized by the degrade bound, with its 16-token replies held for a rewind (11 blocks)
    degraded = ResidencyPolicy.parse("sinks_window:4:64")
    assert health["admission"]["memory_ceiling"] == 32 // blocks_per_session(
        degraded, config.engine_config()) == 2


# ---- the event loop's time per message, for the worst text messages ----------------------------
LOOP_BUDGET_S = 1e-3  # of the loop thread's CPU time, per message and per frame it made
# ... on the host it was set on (an AVX512-BF16 Zen 4); a slower host scales it by its own
# tokenizing time (`tests.host_speed`):
# on a Zen 1-class EPYC at ~2 GHz the 8,192 mixed scripts' median was 1.28 ms of loop time,
# with nothing on the loop but what belongs there. Tokenizing there costs more in the same
# proportion, so work put on the loop by mistake still fails the scaled budget.
_rng = random.Random(25)
_SCRIPTS = [(0x21, 0x7F), (0x400, 0x4FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F5FF)]


def _mixed(num_chars: int) -> str:
    """Latin, Cyrillic, CJK and emoji: 1-4 UTF-8 bytes a character, the tokenizer's worst."""
    return "".join(chr(_rng.randrange(*_rng.choice(_SCRIPTS))) for _ in range(num_chars))


WORST_TEXT_MESSAGES = {  # kind -> (message, how many to send, on how many connections in turn)
    # (accepted while the queue holds it: 8,192 bytes, half the 16,384-token bound)
    "8,192 printable ASCII (two accepted, then refused)": (item(printable(8192, _rng)), 20, 1),
    "8,192 mixed scripts (refused: may exceed the queue)": (item(_mixed(8192)), 20, 1),
    # one of the 3 is accepted (the others may exceed the queue behind it): 5 connections
    # give 20 timed calls, so the 90th percentile is not one slow call in 4
    "4,000 printable ASCII (accepted, tokenized off the loop)": (item(printable(4000, _rng)), 3, 5),
    "1,300 mixed scripts (accepted, tokenized off the loop)": (
        item(_mixed(1300)[:1300]), 3, 5),
    "64 one-word parts (the most a message may hold)": (json.dumps({
        "type": "conversation.item.create", "item": {"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "hi"}] * 64}}), 20, 1),
    "150 one-word items in a burst": (item("hi"), 150, 1),
}


def test_the_worst_text_messages_cost_the_loop_under_a_millisecond_each(smollm2, monkeypatch):
    """Each message's handling on the loop (`Connection._on_message`) and each frame or
    piece of context it made (`Intake._prepared`, `Intake._context_prepared`, which put it
    in the stream) is timed in the loop thread's CPU
    time (a busy machine's preemption and the engine thread's GIL are not the loop's work)."""
    costs_s: dict[str, list[float]] = {}
    kind = [""]

    def timed(method):
        def wrapper(*args, **kwargs):
            started = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                costs_s.setdefault(kind[0], []).append(time.thread_time() - started)
        return wrapper

    monkeypatch.setattr(Connection, "_on_message", timed(Connection._on_message))
    monkeypatch.setattr(Intake, "_prepared", timed(Intake._prepared))
    monkeypatch.setattr(Intake, "_context_prepared", timed(Intake._context_prepared))
    config = ServerConfig(**TEXT_SERVER, pool_tokens=16384, admission="off", mode="turn")
    # A served process holds its own objects only; this one holds every earlier test's, and a
    # collection that walks them landed in a timed call (CI, after ~300 tests: p90 over 1 ms
    # in one kind; alone: 0.1-0.7 ms). Freezing them keeps collections to what the server
    # allocates, as in a real server process.
    gc.collect()
    gc.freeze()
    try:
        with ServerThread(config, smollm2, load_tokenizer()) as server:
            for kind[0], (message, count, connections) in WORST_TEXT_MESSAGES.items():
                for _ in range(connections):
                    _send_and_settle(server.ws_url, message, count)
    finally:
        gc.unfreeze()
    report = {k: (len(v), statistics.median(v) * 1e3, max(v) * 1e3)
              for k, v in costs_s.items()}
    for name, (calls, median_ms, worst_ms) in report.items():
        print(f"loop time per call, {name}: {calls} calls, median {median_ms:.3f} ms, at most "
              f"{worst_ms:.3f} ms")
    # The median: work done on the loop by mistake is in every call (tokenizing the 4,000
    # printable characters here takes 2.4 ms, the 8,192 5 ms), while a shared 2-core machine
    # puts its noise in a few (a cache-cold or hyperthread-shared slice: a p90 of 1.16 ms of
    # 20 calls once in CI, with 0.3-0.5 ms typical; the worst is printed).
    budget_s = LOOP_BUDGET_S * host_slowness()
    print(f"loop budget on this host: {budget_s * 1e3:.2f} ms")
    over = {name: f"median {median_ms:.3f} ms of {calls} calls" for name, (calls, median_ms, _)
            in report.items() if median_ms >= budget_s * 1e3}
    assert not over, f"over the loop budget of {budget_s * 1e3:.2f} ms: {over}"


def _send_and_settle(url: str, message: str, count: int) -> None:
    with connect(url) as ws:
        recv(ws)
        for _ in range(count):
            ws.send(message)
        answered = 0  # each message: an item added (and done), or an error
        while answered < count:
            answered += recv(ws, 30.0)["type"] in ("conversation.item.added", "error")
        time.sleep(0.5)  # the last frames reach the beat (their cost is counted)
