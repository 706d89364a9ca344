"""Sessions survive their replica (`serve.checkpointing`, `cluster.session_store`):
`metronome serve --replicas 2` with the bundled SmolLM2 (text, turn mode) on a local Ray
cluster. kill -9 of the replica holding a session mid-answer: the client resumes through
the same entry point, lands on the survivor, and every answer equals an uninterrupted
session's. Scale 2 -> 1 with a session on each replica: the draining one's session is
checkpointed and closed 4002 ("session moved: resume it"), resumes on the survivor, and
both conversations go on token-exact; none is dropped.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from metronome.serve.protocol import with_extensions
from tests.cluster.client import (
    launched_cluster,
    live_actives,
    ray_address,
    scale,
    view,
    wait_for,
)
from tests.host_speed import UNHURRIED_DEADLINE_FRACTION
from tests.serve.test_serve_resume import QUESTIONS, _answers, _ask
from tests.served import recv, recv_until

pytest.importorskip("ray.serve", reason="the cluster extra (make install) is not installed")

pytestmark = [pytest.mark.wall_clock, pytest.mark.model]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    args = ["--replicas", "2", "--mode", "turn", "--max-response-tokens", "12", "--admission",
            "static", "--admission-cap", "4", "--pool-tokens", "8192",
            "--checkpoint-interval-s", "0.2", "--stats-period-s", "0.25",
            "--drain-timeout-s", "30",
            # unhurried: answers are compared token for token, and a late one is cut short
            "--deadline-fraction", str(UNHURRIED_DEADLINE_FRACTION)]
    with launched_cluster(tmp_path_factory, args, 2, 120) as (url, printed):
        yield url, ray_address(printed)


def _ws_url(url: str) -> str:
    return with_extensions(url.replace("http", "ws") + "/v1/realtime")


def _reference(url: str) -> list[str]:
    with connect(_ws_url(url), open_timeout=30) as ws:
        recv(ws, 30)
        events = []
        for question in QUESTIONS:
            _ask(ws, question)
            events += recv_until(ws, "response.done", timeout_s=60.0)
    return _answers(events)


def _open(url: str):
    ws = connect(_ws_url(url), open_timeout=30)
    created = recv(ws, 30)["session"]
    return ws, created["id"], created["metronome"]["resume"]["token"]


def _resume(url: str, session_id: str, token: str, timeout_s: float = 60.0):
    """Resume through the entry point, retrying while no replica can take it yet (a 503:
    the one reached is draining; a killed replica's connection refused by the proxy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return connect(_ws_url(url) + f"&resume={session_id}", open_timeout=30,
                           additional_headers={"Metronome-Resume-Token": token})
        except (InvalidStatus, OSError) as err:
            status = getattr(getattr(err, "response", None), "status_code", None)
            assert status in (None, 502, 503), err
            assert time.monotonic() < deadline, err
            time.sleep(0.5)


def test_kill_9_mid_answer_resumes_on_the_survivor_token_exact(launched):
    url, _ = launched
    expected = _reference(url)
    wait_for(lambda: live_actives(url) == [0, 0], 15, "no session open")
    ws, session_id, token = _open(url)
    sent = _ask(ws, QUESTIONS[0], "q0")
    events = recv_until(ws, "response.done", timeout_s=60.0)
    victim = wait_for(lambda: [r for r in view(url)["replicas"]
                               if r["active_sessions"] == 1], 10, "the session's replica")[0]
    time.sleep(0.5)  # its checkpoint after the answer, if the interval allowed one
    sent += _ask(ws, QUESTIONS[1], "q1")
    recv_until(ws, "response.created")
    os.kill(victim["pid"], signal.SIGKILL)
    with pytest.raises(ConnectionClosed):
        while True:
            ws.recv(timeout=10)
    with _resume(url, session_id, token) as again:
        resumed = recv(again, 30)
        assert resumed["type"] == "metronome.session.resumed", resumed
        assert resumed["resumed"]["from_checkpoint"] is True
        # The survivor holds the checkpoint's client events and the logged ones after it
        # (replayed): the events the victim applied but died before logging are sent again.
        # The responses since the checkpoint are made anew, one per response.create
        # replayed or sent again: Q1's if the checkpoint after the first answer was stored,
        # Q0's and Q1's if only the opening one was, none if the victim answered Q1 and
        # checkpointed it before it died (a loaded machine: those events died with it,
        # README "Resume on another replica", limits).
        held = resumed["resumed"]["client_events"]
        checkpointed = held - resumed["resumed"]["replayed_client_events"]
        assert 0 <= checkpointed <= held <= len(sent), resumed
        assert resumed["resumed"]["last_client_event_id"] == (
            json.loads(sent[held - 1])["event_id"] if held else None), resumed
        for text in sent[held:]:
            again.send(text)
        turns = sum('"response.create"' in text for text in sent[checkpointed:])
        after = []
        for _ in range(turns):
            after += recv_until(again, "response.done", timeout_s=60.0)
        _ask(again, QUESTIONS[2])
        after += recv_until(again, "response.done", timeout_s=60.0)
    assert _answers(events) == expected[:1]
    assert _answers(after) == expected[2 - turns:]  # turns 0: A2 only


def test_scale_2_to_1_moves_the_draining_replicas_session_token_exact(launched):
    url, address = launched
    wait_for(lambda: live_actives(url) == [0, 0], 120, "two idle replicas (after a kill)")
    expected = _reference(url)
    sessions = []
    for on_each in ([0, 1], [1, 1]):
        sessions.append(_open(url))
        wait_for(lambda on_each=on_each: live_actives(url) == on_each, 10, f"{on_each}")
    events = {sid: [] for _, sid, _ in sessions}
    for ws, sid, _ in sessions:
        _ask(ws, QUESTIONS[0])
        events[sid] += recv_until(ws, "response.done", timeout_s=60.0)
    scale(address, 1)
    moved = []
    for k, (ws, sid, token) in enumerate(sessions):
        try:
            ws.recv(timeout=15)  # the draining replica's session is closed 4002 at once
        except TimeoutError:
            continue  # the survivor's: not closed
        except ConnectionClosed as closed:
            assert closed.rcvd is not None and (closed.rcvd.code, closed.rcvd.reason) == (
                4002, "session moved: resume it"), closed
        else:
            raise AssertionError("no event was due")
        moved.append(sid)
        again = _resume(url, sid, token)
        resumed = recv(again, 30)
        assert resumed["resumed"]["from_checkpoint"] is True
        assert resumed["resumed"]["replayed_client_events"] == 0  # nothing was in flight
        sessions[k] = (again, sid, token)
    assert len(moved) == 1
    for ws, sid, _ in sessions:
        for question in QUESTIONS[1:]:
            _ask(ws, question)
            events[sid] += recv_until(ws, "response.done", timeout_s=60.0)
        ws.close()
    for sid in events:
        assert _answers(events[sid]) == expected, sid
    assert len(view(url)["replicas"]) >= 1
