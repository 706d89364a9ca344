"""`metronome serve --replicas 2` on a local Ray cluster (loopback, the tiny preset model,
one torch thread per replica): sessions placed by admission headroom, a full replica
skipped, every replica full refused as the plain server refuses, the cluster view and the
replica label on metrics, and kill -9 of a replica. One cluster for the module: Ray's start
is the slow part; the kill test runs last.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.served import free_port, server_process

pytest.importorskip("ray.serve", reason="the cluster extra (make install) is not installed")

CAP = 2  # sessions per replica (static admission)
METRONOME = str(Path(sys.executable).parent / "metronome")


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def view(url: str) -> dict:
    return httpx.get(url + "/v1/cluster", timeout=5).json()


def actives(url: str) -> list[int]:
    return sorted(r["active_sessions"] for r in view(url)["replicas"])


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    command = [METRONOME, "serve", "--replicas", "2", "--model", "preset:tiny", "--port",
               str(port), "--admission", "static", "--admission-cap", str(CAP),
               "--stats-period-s", "0.25", "--log-level", "warning"]
    with server_process(command, port) as url:
        wait_for(lambda: view(url)["replicas_live"] == 2, 60, "both replicas' reports")
        yield url


def open_session(ws_url: str):
    ws = connect(ws_url, open_timeout=10)
    assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
    return ws


def test_sessions_split_by_headroom_and_all_full_is_refused_with_retry_after(cluster):
    ws_url = cluster.replace("http", "ws") + "/v1/realtime"
    # back to back, faster than the replicas report: the router counts its own placements
    sessions = []
    try:
        for _ in range(2 * CAP):
            sessions.append(open_session(ws_url))
        wait_for(lambda: actives(cluster) == [CAP, CAP], 10, f"{CAP} sessions on each")
        with pytest.raises(InvalidStatus) as refused:  # every replica full
            connect(ws_url, open_timeout=10)
        response = refused.value.response
        assert response.status_code == 503 and response.headers["Retry-After"] == "2"
        assert json.loads(response.body)["error"]["code"] == "server_at_capacity"
        sessions.pop().close()  # room on one replica only: the next session finds it
        wait_for(lambda: actives(cluster) == [CAP - 1, CAP], 10, "the close reported")
        sessions.append(open_session(ws_url))
        wait_for(lambda: actives(cluster) == [CAP, CAP], 10, "the full one skipped")
    finally:
        for ws in sessions:
            ws.close()
    wait_for(lambda: actives(cluster) == [0, 0], 10, "every session closed")


def test_cluster_view_lists_each_replica_and_metrics_carry_its_label(cluster):
    listed = view(cluster)
    assert listed["status"] == "ok" and listed["cap"] == 2 * CAP
    ids = {r["replica"] for r in listed["replicas"]}
    assert len(ids) == 2
    for replica in listed["replicas"]:
        assert replica["cap"] == CAP and replica["kv_pool"]["num_blocks"] == 65536 // 16
        assert replica["status"] == "ok" and replica["kv_stall"] == "ok"
    text = httpx.get(cluster + "/metrics", timeout=5).text
    labelled = [line for line in text.splitlines() if line.startswith(
        "metronome_admission_cap{")]
    assert len(labelled) == 1 and any(f'replica="{i}"' in labelled[0] for i in ids)



def closed_within(ws, timeout_s: float) -> bool:
    try:
        while True:
            ws.recv(timeout=timeout_s)
    except ConnectionClosed:
        return True
    except TimeoutError:
        return False


def test_kill_9_of_a_replica_ends_only_its_sessions_and_ray_replaces_it(cluster):
    ws_url = cluster.replace("http", "ws") + "/v1/realtime"
    sessions = [open_session(ws_url), open_session(ws_url)]  # one on each
    try:
        wait_for(lambda: actives(cluster) == [1, 1], 10, "one session on each replica")
        before = {r["replica"]: r for r in view(cluster)["replicas"]}
        victim = next(iter(before.values()))
        os.kill(victim["pid"], signal.SIGKILL)
        closed = [closed_within(ws, 2.0) for ws in sessions]
        assert sorted(closed) == [False, True]  # its session's socket drops (no close
        # frame: Ray's proxy sends none), the other replica's session stays open
        survivor = open_session(ws_url)  # new sessions go to the live replica meanwhile
        survivor.close()
        replaced = wait_for(lambda: [r for r in view(cluster)["replicas"] if r["replica"]
                                     not in before and r["status"] == "ok"], 90,
                            "Ray's replacement replica reporting")
        assert len(replaced) == 1 and replaced[0]["active_sessions"] == 0
    finally:
        for ws in sessions:
            ws.close()
