"""Resuming a session after its connection drops (`serve.resume`), end to end on a real server
with the bundled SmolLM2: the answer under way at the drop stops there (a dropped client
keeps no engine busy), token-exact as far as it got against an uninterrupted session with
the same inputs, whether the socket ended with a FIN or a reset, and the session goes on;
the events produced before the client was noticed gone are delivered in order on resume;
a lease that expires gives every block back; tokens resume once, only their own session,
only with the session's key; and a resume while the old socket still looks open takes the
session over (4001)."""

from __future__ import annotations

import json
import socket
import struct
import time

import httpx
import pytest
from pydantic import SecretStr
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import with_extensions
from metronome.serve.server import ServerThread
from tests.host_speed import UNHURRIED_DEADLINE_FRACTION
from tests.served import TEXT_SERVER, metric, recv, recv_until

pytestmark = pytest.mark.model

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Name a river there."]
# Unhurried: answers are compared token for token, and a late one would be cut short.
CONFIG = ServerConfig(**(TEXT_SERVER | {"max_response_tokens": 12}),
                      mode="turn", admission="off", pool_tokens=8192,
                      resume_grace_s=30.0, deadline_fraction=UNHURRIED_DEADLINE_FRACTION)


def _item(text: str) -> str:
    return json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})


def _ask(ws, question: str, name: str | None = None) -> list[str]:
    """Send the question and a `response.create` (`name`: with the event_ids `name`-item and
    `name`-create); the texts sent."""
    ids = {} if name is None else {"event_id": f"{name}-item"}
    texts = [json.dumps(ids | json.loads(_item(question))), json.dumps(
        ({} if name is None else {"event_id": f"{name}-create"}) | {"type": "response.create"})]
    for text in texts:
        ws.send(text)
    return texts


def _resume_url(server, session_id: str, last_event_id: str | None = None) -> str:
    url = with_extensions(server.ws_url) + f"&resume={session_id}"
    return url + (f"&last_event_id={last_event_id}" if last_event_id else "")


def _resume(server, session_id: str, token: str, last_event_id: str | None = None, **kw):
    headers = {"Metronome-Resume-Token": token} | kw.pop("additional_headers", {})
    return connect(_resume_url(server, session_id, last_event_id), additional_headers=headers,
                   **kw)


def _answers(events: list[dict]) -> list[str]:
    """The text of each completed response, in order."""
    return ["".join(c.get("text") or "" for item in e["response"]["output"]
                    for c in item["content"]) for e in events if e["type"] == "response.done"]


def _drop(ws, reset: bool) -> None:
    """The connection goes without a close frame: a FIN, or a reset (RST). (A bare `close`
    would wait for the client's reader thread, blocked in `recv` on the socket.)"""
    if reset:
        ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        ws.socket.shutdown(socket.SHUT_RD)  # wakes the reader; the close then resets
    else:
        ws.socket.shutdown(socket.SHUT_RDWR)
    ws.socket.close()


def _wait_leased(server, session_id: str, headers: dict | None = None) -> dict:
    deadline = time.monotonic() + 10.0
    while True:
        listed = {s["id"]: s for s in httpx.get(server.url + "/v1/sessions",
                                                 headers=headers).json()["data"]}
        if listed.get(session_id, {}).get("connection") == "leased":
            return listed[session_id]
        assert time.monotonic() < deadline, listed
        time.sleep(0.02)


def _uninterrupted(server) -> list[str]:
    with connect(with_extensions(server.ws_url)) as ws:
        recv(ws)
        events = []
        for question in QUESTIONS:
            _ask(ws, question)
            events += recv_until(ws, "response.done", timeout_s=60.0)
    return _answers(events)


@pytest.fixture(scope="module")
def server(smollm2):
    with ServerThread(CONFIG, smollm2, load_tokenizer()) as running:
        yield running


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_a_dropped_session_resumes_token_exact(server, reset):
    expected = _uninterrupted(server)
    ws = connect(with_extensions(server.ws_url))
    created = recv(ws)["session"]
    session_id, resume = created["id"], created["metronome"]["resume"]
    assert resume["grace_s"] == 30.0 and len(resume["token"]) >= 40
    _ask(ws, QUESTIONS[0], "q0")
    seen = recv_until(ws, "response.created")  # its frame is in the beat: drop mid-answer
    _drop(ws, reset)
    leased = _wait_leased(server, session_id)
    assert 0 < leased["lease_expires_in_s"] <= 30.0
    health = httpx.get(server.url + "/healthz").json()
    assert health["leased_sessions"] == 1 and health["sessions"] == 1  # admission counts it
    time.sleep(1.0)  # nothing more is made while the client is away
    with _resume(server, session_id, resume["token"], seen[-1]["event_id"]) as again:
        resumed = recv(again)
        assert resumed["type"] == "metronome.session.resumed"
        assert resumed["session"]["id"] == session_id
        assert resumed["resumed"]["missed_events"] == 0
        assert resumed["resumed"]["away_s"] >= 1.0
        assert (resumed["resumed"]["client_events"],  # it holds both of the client's
                resumed["resumed"]["last_client_event_id"]) == (2, "q0-create")
        assert resumed["session"]["metronome"]["resume"]["token"] != resume["token"]
        replayed = [recv(again) for _ in range(resumed["resumed"]["replayed_events"])]
        # the answer under way stopped at the drop (a dropped client keeps no engine busy):
        # replayed as far as it got, cancelled, none of it twice
        done = [e for e in replayed if e["type"] == "response.done"]
        assert len(done) == 1 and done[0]["response"]["status"] == "cancelled", replayed
        assert not ({e["event_id"] for e in replayed} & {e["event_id"] for e in seen})
        events = seen + replayed
        for question in QUESTIONS[1:]:
            _ask(again, question)
            events += recv_until(again, "response.done", timeout_s=60.0)
    answers = _answers(events)
    assert expected[0].startswith(answers[0])  # token-exact as far as it got
    assert len(answers) == len(QUESTIONS) and all(answers[1:]), (expected, answers)
    frames = [e["frame"]["index"] for e in events if e["type"] == "metronome.frame"]
    assert sorted(frames) == list(range(len(frames)))  # numbering goes on (a cancelled
    # reply's frame may be answered before the input frame ahead of it)
    assert metric(server, "metronome_session_resumes_total", outcome="resumed") >= 1


def test_without_last_event_id_the_replay_starts_where_the_old_connection_stopped(server):
    ws = connect(with_extensions(server.ws_url))
    created = recv(ws)["session"]
    _ask(ws, QUESTIONS[0])
    seen = recv_until(ws, "response.done", timeout_s=60.0)
    _drop(ws, reset=False)
    _wait_leased(server, created["id"])
    with _resume(server, created["id"], created["metronome"]["resume"]["token"]) as again:
        resumed = recv(again)
        # every event went out before the drop: nothing to replay, nothing sent twice
        assert resumed["resumed"]["replayed_events"] == 0, (resumed, seen[-1])
        _ask(again, QUESTIONS[1])
        assert recv_until(again, "response.done", timeout_s=60.0)[-1]["response"][
            "status"] == "completed"


def test_refused_resumes_are_clear_and_change_nothing(server):
    with connect(with_extensions(server.ws_url)) as other:
        other_token = recv(other)["session"]["metronome"]["resume"]["token"]
        ws = connect(with_extensions(server.ws_url))
        created = recv(ws)["session"]
        session_id, token = created["id"], created["metronome"]["resume"]["token"]
        _drop(ws, reset=True)
        _wait_leased(server, session_id)
        for wrong in ("x" * 43, other_token, ""):
            with pytest.raises(InvalidStatus) as refused:
                _resume(server, session_id, wrong)
            assert refused.value.response.status_code == 404
            error = json.loads(refused.value.response.body)["error"]
            assert error["code"] == "resume_refused"
            assert session_id in error["message"]
        with pytest.raises(InvalidStatus):  # an unknown session: the same answer
            _resume(server, "sess_" + "0" * 20, token)
        with _resume(server, session_id, token) as again:  # still leased, still resumable
            assert recv(again)["type"] == "metronome.session.resumed"
        with pytest.raises(InvalidStatus) as replayed:  # a token resumes once
            _resume(server, session_id, token)
        assert replayed.value.response.status_code == 404
    assert metric(server, "metronome_session_resumes_total", outcome="refused_token") >= 5


def test_a_resume_takes_over_a_connection_that_still_looks_open(server):
    with connect(with_extensions(server.ws_url)) as old:
        created = recv(old)["session"]
        with _resume(server, created["id"], created["metronome"]["resume"]["token"]) as new:
            resumed = recv(new)
            assert resumed["resumed"]["away_s"] == 0.0
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    old.recv(timeout=10)
            assert closed.value.rcvd.code == 4001
            _ask(new, QUESTIONS[0])
            assert recv_until(new, "response.done", timeout_s=60.0)[-1]["response"][
                "status"] == "completed"


def test_a_lease_expires_after_the_grace_and_gives_every_block_back(smollm2):
    config = CONFIG.model_copy(update={"resume_grace_s": 0.5})
    with ServerThread(config, smollm2, load_tokenizer()) as server:
        before = httpx.get(server.url + "/healthz").json()["kv_pool"]["used_blocks"]
        ws = connect(with_extensions(server.ws_url))
        created = recv(ws)["session"]
        _ask(ws, QUESTIONS[0])
        recv_until(ws, "response.done", timeout_s=60.0)
        _drop(ws, reset=False)
        _wait_leased(server, created["id"])
        time.sleep(1.0)
        with pytest.raises(InvalidStatus) as refused:
            _resume(server, created["id"], created["metronome"]["resume"]["token"])
        assert refused.value.response.status_code == 404
        health = httpx.get(server.url + "/healthz").json()
        assert health["sessions"] == 0 and health["leased_sessions"] == 0
        assert health["kv_pool"]["used_blocks"] == before
        assert metric(server, "metronome_session_leases_ended_total",
                      outcome="lease_expired") == 1
        assert metric(server, "metronome_sessions_total", outcome="lease_expired") == 1


def test_only_the_sessions_key_resumes_it_and_plain_clients_are_not_leased(smollm2):
    config = CONFIG.model_copy(update={"api_key": SecretStr("k" * 32)})
    auth = {"Authorization": "Bearer " + "k" * 32}
    with ServerThread(config, smollm2, load_tokenizer()) as server:
        ws = connect(with_extensions(server.ws_url), additional_headers=auth)
        created = recv(ws)["session"]
        _drop(ws, reset=False)
        _wait_leased(server, created["id"], auth)
        token = created["metronome"]["resume"]["token"]
        with pytest.raises(InvalidStatus) as refused:  # another key: refused at the door
            _resume(server, created["id"], token,
                    additional_headers={"Authorization": "Bearer " + "j" * 32})
        assert refused.value.response.status_code == 401
        with _resume(server, created["id"], token, additional_headers=auth) as again:
            assert recv(again)["type"] == "metronome.session.resumed"
        plain = connect(server.ws_url, additional_headers=auth)  # no extensions: no token
        assert "metronome" not in recv(plain)["session"]
        _drop(plain, reset=False)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/healthz", headers=auth).json()["sessions"] > 0:
            assert time.monotonic() < deadline  # ended at once, as before
            time.sleep(0.02)

