"""Dropped sessions as an attack (issue 43), on `metronome serve` (a subprocess on 127.0.0.1,
with an API key and resume tokens), beside the same well-behaved speech streamer as the
attack suite (`test_serve_attacks`), each in an `AttackWindow`: the streamer's frames answered
meanwhile are on time (>= 99 %), the loop's lag probes stay under 50 ms, and sessions, KV
blocks and connections are back where they were afterwards.

- 200 sessions opened and dropped (no close frame) by one peer: it holds at most
  `--max-leases-per-peer` of them for a resume; past that each one ends at once and its
  blocks go back (before: all 200 leased while the peer held no socket).
- 32 sessions (two peers' lease caps) each with a text item queued and a reply under way,
  dropped together: held in the beat (their frames answered `cancelled`, nothing fed), so
  the neighbour keeps its beat (before: 0/3 frames on time while they were leased); each
  is then resumed and its input is fed.

Its own server (a pool for 32 sessions' bounds): a module of its own, so that it never runs
beside the attack suite's server."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from served import SHARED_CPU_ENV, free_port, metric_samples, served
from streamer import SpeechStreamer, recv
from test_serve_attacks import (
    BEARER,
    CONFIG,
    AttackWindow,
    RssSampler,
    World,
    server_pid,
)
from websockets.sync.client import connect

from metronome.serve.protocol import with_extensions
from tests.host_speed import deadline_fraction

pytestmark = pytest.mark.model
MAX_LEASES_PER_PEER = 16
LEASE_CONFIG = CONFIG.model_copy(update={
    "pool_tokens": 24576, "max_leases_per_peer": MAX_LEASES_PER_PEER, "resume_grace_s": 30.0})
DROPS = 200
LEASED = 32
QUEUED_TEXT = "the quick brown fox jumps over the lazy dog " * 70  # ~3,100 bytes, ~630 tokens


@pytest.fixture(scope="module")
def world():
    config = LEASE_CONFIG.model_copy(update={"deadline_fraction": deadline_fraction(1.0),
                                             "health_port": free_port()})
    with served(config, SHARED_CPU_ENV) as url:
        pid = server_pid(int(url.rsplit(":", 1)[1]))
        streamer = SpeechStreamer(url.replace("http", "ws", 1) + "/v1/realtime",
                                  additional_headers=BEARER)
        streamer.start()
        yield World(url, pid, streamer, RssSampler(pid), config.health_port)
        sent = streamer.stop()
        late = streamer.late_frames
        print(f"streamer: {len(streamer.frames)} frames, {len(late)} late")
        assert len(streamer.frames) == sent and streamer.errors == []
        assert 1 - len(late) / max(1, len(streamer.frames)) >= 0.99, late


def _metric(world: World, name: str) -> float:
    return sum(sample.value for sample in metric_samples(world, name, headers=BEARER))


def _open(world: World, source: str):
    """A session with resume tokens (`metronome_events`), from loopback address `source`;
    (its connection, its id, its resume token)."""
    ws = connect(with_extensions(world.ws_url), additional_headers=BEARER,
                 source_address=(source, 0))
    created = recv(ws)["session"]
    return ws, created["id"], created["metronome"]["resume"]["token"]


def _drop(ws) -> None:
    """Gone without a close frame (a FIN): the server may hold the session for a resume."""
    ws.socket.shutdown(socket.SHUT_RDWR)
    ws.socket.close()


def _noticed_gone(world: World, session_id: str) -> None:
    """Wait until the server has seen the client go (the session is leased or ended)."""
    deadline = time.monotonic() + 5.0
    while True:
        listed = {s["id"]: s for s in httpx.get(world.url + "/v1/sessions",
                                                 headers=BEARER).json()["data"]}
        if listed.get(session_id, {}).get("connection") != "connected":
            return
        assert time.monotonic() < deadline, listed.get(session_id)
        time.sleep(0.01)


def _leased(world: World) -> int:
    return httpx.get(world.url + "/healthz", headers=BEARER).json()["leased_sessions"]


def _resume_and_close(world: World, held: list[tuple[str, str]]) -> int:
    """Resume each held session (from a few addresses: a peer's resumes are rate-limited)
    and close it; how many resumed."""
    resumed = 0
    for k, (session_id, token) in enumerate(held):
        url = with_extensions(world.ws_url) + f"&resume={session_id}"
        with connect(url, additional_headers=BEARER | {"Metronome-Resume-Token": token},
                     source_address=(f"127.0.2.{1 + k % 8}", 0),
                     max_queue=None) as ws:  # (the replay unread: its close is not held up)
            resumed += recv(ws)["type"] == "metronome.session.resumed"
    return resumed


def test_a_peers_dropped_sessions_past_its_lease_cap_end_and_give_their_blocks_back(world):
    peer = "127.0.0.50"
    refused_before = _metric(world, "metronome_session_leases_refused_total")
    held: list[tuple[str, str]] = []
    with AttackWindow(world, f"{DROPS} sessions opened and dropped (no close frame) by one "
                      "peer") as window:
        for _ in range(DROPS):  # one after another: the KV pool holds 40 sessions at once
            ws, session_id, token = _open(world, peer)
            _drop(ws)
            _noticed_gone(world, session_id)
            held.append((session_id, token))
        leased = _leased(world)
        refused = _metric(world, "metronome_session_leases_refused_total") - refused_before
        listed = {s["id"] for s in httpx.get(world.url + "/v1/sessions",
                                             headers=BEARER).json()["data"]}
        still = [(sid, token) for sid, token in held if sid in listed]
        window.attempts = DROPS
        resumed = _resume_and_close(world, still)
        window.notes.append(f"{leased} held for a resume (cap {MAX_LEASES_PER_PEER}), "
                            f"{refused:.0f} ended at once (their blocks back); the held ones "
                            f"resumed {resumed}/{len(still)}")
    assert leased == len(still) == MAX_LEASES_PER_PEER
    assert refused == DROPS - MAX_LEASES_PER_PEER
    assert resumed == MAX_LEASES_PER_PEER


def test_leased_sessions_are_held_and_leave_a_neighbour_on_time(world):
    item = json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user",
        "content": [{"type": "input_text", "text": QUEUED_TEXT}]}})
    peers = ["127.0.0.51", "127.0.0.52"]  # two peers: each holds its lease cap
    held: list[tuple[str, str]] = []
    with AttackWindow(world, f"{LEASED} sessions, each with ~630 tokens of text queued and a "
                      "reply asked for, dropped together and held for the grace") as window:
        opened = [_open(world, peers[k % 2]) for k in range(LEASED)]
        for ws, _, _ in opened:  # 32 clients, each a text and a reply in turn
            ws.send(item)
            ws.send(json.dumps({"type": "response.create"}))
            time.sleep(0.02)
        for ws, session_id, token in opened:
            _drop(ws)
            held.append((session_id, token))
        waited_s = 0.0
        while _leased(world) < LEASED and waited_s < 10.0:
            waited_s += 0.1
            time.sleep(0.1)
        leased = _leased(world)
        time.sleep(6.0)  # the neighbour streams beside the held sessions
        window.attempts = LEASED
        resumed = _resume_and_close(world, held)
        window.notes.append(f"{leased} held; the neighbour streamed 6 s beside them; resumed "
                            f"{resumed}/{LEASED}")
    assert leased == LEASED and resumed == LEASED


def test_a_key_is_needed_to_resume(world):
    """(A resume without the server's key is refused before the upgrade.)"""
    ws, session_id, token = _open(world, "127.0.0.53")
    _drop(ws)
    url = with_extensions(world.ws_url) + f"&resume={session_id}"
    with pytest.raises(Exception):  # noqa: B017 - 401 before the upgrade
        connect(url, additional_headers={"Metronome-Resume-Token": token})
    assert _resume_and_close(world, [(session_id, token)]) == 1
