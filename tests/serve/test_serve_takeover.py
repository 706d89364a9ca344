"""A session another server held, resumed here from its checkpoint (`serve.checkpointing`),
end to end on two real servers with the bundled SmolLM2 sharing one checkpoint store (a
cluster's is `cluster.session_store`): the continuation is token-exact against an
uninterrupted session when the old server never answers again, with a question still in
flight (its events are replayed from the store's log); a claim needs the session's token
and key, moves the session for good (the old server's later writes are refused), and an
unbounded session is never checkpointed, so its resume elsewhere is refused."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from metronome.model.weights import load_tokenizer
from metronome.serve.protocol import with_extensions
from metronome.serve.resume.checkpoint import MemoryCheckpointStore
from metronome.serve.server import ServerThread
from tests.serve.test_serve_resume import (
    CONFIG,
    QUESTIONS,
    _answers,
    _ask,
    _drop,
    _resume,
    _uninterrupted,
)
from tests.served import metric, recv, recv_until

pytestmark = pytest.mark.model

TAKEOVER = CONFIG.model_copy(update={"checkpoint_interval_s": 0.1})


@contextmanager
def _two_servers(model, store, config=TAKEOVER):
    """Servers "a" and "b" sharing one checkpoint store."""
    tokenizer = load_tokenizer()
    with ServerThread(config, model, tokenizer, checkpoint_store=store,
                      server_name="a") as a, ServerThread(
            config, model, tokenizer, checkpoint_store=store, server_name="b") as b:
        yield a, b


@pytest.fixture(scope="module")
def pair(smollm2):
    store = MemoryCheckpointStore()
    with _two_servers(smollm2, store) as (a, b):
        yield store, a, b


def _open(server):
    """A new session on `server`: its socket, id and resume token."""
    ws = connect(with_extensions(server.ws_url))
    created = recv(ws)["session"]
    return ws, created["id"], created["metronome"]["resume"]["token"]


def _stored(store, session_id: str, client_seq: int) -> dict:
    """Wait until the store holds a checkpoint of the session taken after `client_seq`
    client events."""
    deadline = time.monotonic() + 10.0
    while True:
        entry = store.shelf.describe(session_id)
        if entry is not None and entry["client_seq"] >= client_seq:
            return entry
        assert time.monotonic() < deadline, entry
        time.sleep(0.02)


def test_a_session_resumes_on_another_server_token_exact(pair):
    store, a, b = pair
    expected = _uninterrupted(a)
    ws, session_id, token = _open(a)
    _ask(ws, QUESTIONS[0])
    events = recv_until(ws, "response.done", timeout_s=60.0)
    entry = _stored(store, session_id, 2)  # after the first answer: item + response.create
    assert entry["owner"] == "a" and entry["checkpoint_bytes"] > 100_000
    _ask(ws, QUESTIONS[1])  # in flight when the client loses server a
    recv_until(ws, "response.created")
    _drop(ws, reset=True)
    with _resume(b, session_id, token) as again:  # server a never answers again
        resumed = recv(again)
        assert resumed["type"] == "metronome.session.resumed"
        assert resumed["resumed"]["from_checkpoint"] is True
        assert resumed["resumed"]["replayed_client_events"] == 2
        assert resumed["session"]["id"] == session_id
        new_token = resumed["session"]["metronome"]["resume"]["token"]
        assert new_token != token
        events += recv_until(again, "response.done", timeout_s=60.0)  # made anew on b
        _ask(again, QUESTIONS[2])
        events += recv_until(again, "response.done", timeout_s=60.0)
        assert store.shelf.describe(session_id)["owner"] == "b"
    assert _answers(events) == expected
    frames = [e["frame"]["index"] for e in events if e["type"] == "metronome.frame"]
    assert frames == sorted(frames) and len(set(frames)) == len(frames)  # numbering goes on
    assert metric(b, "metronome_session_resumes_total", outcome="restored") >= 1
    assert metric(a, "metronome_session_checkpoints_total", outcome="stored") >= 2


def test_a_claim_needs_the_token_and_moves_the_session_for_good(pair):
    store, a, b = pair
    ws, session_id, token = _open(a)
    _stored(store, session_id, 0)  # a new session is checkpointed at once
    _drop(ws, reset=False)
    for wrong in ("x" * 43, ""):
        with pytest.raises(InvalidStatus) as refused:
            _resume(b, session_id, wrong)
        assert refused.value.response.status_code == 404
        assert json.loads(refused.value.response.body)["error"]["code"] == "resume_refused"
    assert store.shelf.describe(session_id)["owner"] == "a"  # a wrong token changed nothing
    with _resume(b, session_id, token) as again:
        assert recv(again)["resumed"]["from_checkpoint"] is True
        with pytest.raises(InvalidStatus):  # the old token is spent: not on a, not on b
            _resume(a, session_id, token)
        _ask(again, QUESTIONS[0])
        assert recv_until(again, "response.done", timeout_s=60.0)[-1]["response"][
            "status"] == "completed"
    entry = store.shelf.describe(session_id)  # None once b has ended it and forgotten it
    assert entry is None or entry["owner"] == "b"


def test_an_unbounded_session_is_not_resumed_elsewhere(smollm2):
    store = MemoryCheckpointStore()
    config = TAKEOVER.model_copy(update={"policy": "unbounded"})
    with _two_servers(smollm2, store, config) as (a, b):
        ws = connect(with_extensions(a.ws_url))
        created = recv(ws)["session"]
        deadline = time.monotonic() + 10
        while metric(a, "metronome_session_checkpoints_total", outcome="unbounded") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        _drop(ws, reset=False)
        with pytest.raises(InvalidStatus) as refused:
            _resume(b, created["id"], created["metronome"]["resume"]["token"])
        assert refused.value.response.status_code == 404
        assert "unbounded" in json.loads(refused.value.response.body)["error"]["message"]
        assert len(store.shelf) == 0
        assert httpx.get(a.url + "/healthz").json()["leased_sessions"] == 1  # a still holds it


def test_a_server_without_room_refuses_the_take_over_and_the_token_still_resumes(pair,
                                                                                  smollm2):
    store, a, b = pair
    small = TAKEOVER.model_copy(update={"pool_tokens": 16})  # 1 block: not the session's
    with ServerThread(small, smollm2, load_tokenizer(), checkpoint_store=store,
                      server_name="c") as c:
        ws, session_id, token = _open(a)
        _ask(ws, QUESTIONS[0])
        recv_until(ws, "response.done", timeout_s=60.0)
        _stored(store, session_id, 2)
        assert store.shelf.describe(session_id)["checkpoint_bytes"] > 16 * 23_040  # 2+ blocks
        _drop(ws, reset=False)
        with pytest.raises(InvalidStatus) as refused:
            _resume(c, session_id, token)
        assert refused.value.response.status_code == 503
        assert metric(c, "metronome_session_resumes_total", outcome="refused_pool") == 1
        deadline = time.monotonic() + 10  # the refusal gave the token back to the store
        while not store.shelf.describe(session_id)["resumable"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with _resume(b, session_id, token) as again:
            assert recv(again)["resumed"]["from_checkpoint"] is True
            _ask(again, QUESTIONS[1])
            assert recv_until(again, "response.done", timeout_s=60.0)[-1]["response"][
                "status"] == "completed"


def test_a_replay_of_several_turns_lands_each_event_after_the_response_it_followed(smollm2):
    """Only the opening checkpoint is stored (a long interval), so the take-over replays two
    turns; each turn's events wait for the replayed response before them, as the client
    did (applied at once, the second `response.create` met the first response still
    active and was refused, and the answers diverged)."""
    store = MemoryCheckpointStore()
    config = TAKEOVER.model_copy(update={"checkpoint_interval_s": 3600.0})
    with _two_servers(smollm2, store, config) as (a, b):
        expected = _uninterrupted(a)
        ws, session_id, token = _open(a)
        _ask(ws, QUESTIONS[0])
        recv_until(ws, "response.done", timeout_s=60.0)
        _ask(ws, QUESTIONS[1])
        recv_until(ws, "response.created")
        deadline = time.monotonic() + 10
        while store.shelf.describe(session_id)["logged_events"] < 4:  # both turns logged
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert store.shelf.describe(session_id)["client_seq"] == 0  # the opening one only
        _drop(ws, reset=True)
        with _resume(b, session_id, token) as again:
            resumed = recv(again)
            assert resumed["resumed"]["replayed_client_events"] == 4
            events = recv_until(again, "response.done", timeout_s=60.0)  # turn 1, anew
            events += recv_until(again, "response.done", timeout_s=60.0)  # turn 2
            assert not [e for e in events if e["type"] == "error"], events
            _ask(again, QUESTIONS[2])
            events += recv_until(again, "response.done", timeout_s=60.0)
    assert _answers(events) == expected


def test_a_session_quiet_after_its_answer_is_checkpointed_once_its_interval_passes(smollm2):
    """The answer ends within the interval of the opening checkpoint, and no result follows
    (the user is thinking): the checkpoint is taken when the interval has passed, so a
    take-over would not make that answer anew."""
    store = MemoryCheckpointStore()
    config = TAKEOVER.model_copy(update={"checkpoint_interval_s": 2.0})
    with ServerThread(config, smollm2, load_tokenizer(), checkpoint_store=store,
                      server_name="a") as a, connect(with_extensions(a.ws_url)) as ws:
        session_id = recv(ws)["session"]["id"]
        opened_s = time.monotonic()
        _ask(ws, QUESTIONS[0])
        recv_until(ws, "response.done", timeout_s=60.0)
        assert time.monotonic() - opened_s < 2.0, "the answer outlasted the interval"
        assert store.shelf.describe(session_id)["client_seq"] == 0  # not yet: too soon
        _stored(store, session_id, 2)  # then, with no further result
        assert time.monotonic() - opened_s < 4.0


class _LosingStore(MemoryCheckpointStore):
    """Never gets a session's client events from `lost_from` on: its server applied them and
    died before their appends reached the store."""

    def __init__(self, lost_from: int) -> None:
        super().__init__()
        self.lost_from = lost_from

    async def append(self, session_id, owner, seq, event) -> bool:
        return seq >= self.lost_from or await super().append(session_id, owner, seq, event)


def test_a_client_resends_the_events_its_dead_server_never_logged(smollm2):
    """Server a applied Q1's `response.create` but died before logging it: b's
    `metronome.session.resumed` says it holds 3 of the client's events, the last `q1-item`;
    the client sends the 4th again and every answer is the uninterrupted session's."""
    store = _LosingStore(lost_from=3)
    config = TAKEOVER.model_copy(update={"checkpoint_interval_s": 3600.0})
    with _two_servers(smollm2, store, config) as (a, b):
        expected = _uninterrupted(a)
        ws, session_id, token = _open(a)
        sent = _ask(ws, QUESTIONS[0], "q0")
        recv_until(ws, "response.done", timeout_s=60.0)
        sent += _ask(ws, QUESTIONS[1], "q1")
        recv_until(ws, "response.created")
        _drop(ws, reset=True)
        with _resume(b, session_id, token) as again:
            resumed = recv(again)["resumed"]
            assert (resumed["client_events"], resumed["last_client_event_id"],
                    resumed["replayed_client_events"]) == (3, "q1-item", 3)
            for text in sent[resumed["client_events"]:]:
                again.send(text)
            events = recv_until(again, "response.done", timeout_s=60.0)  # Q0's, anew
            events += recv_until(again, "response.done", timeout_s=60.0)  # Q1's
            assert not [e for e in events if e["type"] == "error"], events
            _ask(again, QUESTIONS[2])
            events += recv_until(again, "response.done", timeout_s=60.0)
    assert _answers(events) == expected
