"""`metronome serve --replicas 2` on a local Ray cluster (loopback, the tiny preset model,
one torch thread per replica): sessions placed by admission headroom, a full replica
skipped, every replica full refused as the plain server refuses, the cluster view and the
replica label on metrics, kill -9 of a replica, and scale-down's drain. One cluster for the
module (Ray's start is the slow part), but no test relies on another: each first waits for
two idle replicas (`settle`), scaling back to two after a scale-down and waiting out a
killed replica's replacement, so any test runs alone or in any order.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import time

import httpx
import pytest
from openai import AsyncOpenAI
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from metronome.load.speech import SPEECH_DIR, speech_stream
from tests.cluster.client import (
    DrainedStreamer,
    Stamped,
    actives,
    closed_within,
    launched_cluster,
    live,
    live_actives,
    open_session,
    open_session_retrying,
    ray_address,
    scale,
    view,
    wait_for,
)
from tests.host_speed import deadline_fraction, host_slowness

pytest.importorskip("ray.serve", reason="the cluster extra (make install) is not installed")

pytestmark = pytest.mark.wall_clock

CAP = 2  # sessions per replica (static admission)
DRAIN_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The cluster's URL and the Ray address its launcher printed."""
    # Checkpoints off: a draining replica keeps its sessions to the drain timeout, the path
    # tested here (with them, it moves each to a survivor: tests/cluster/test_cluster_resume)
    args = ["--replicas", "2", "--model", "preset:tiny", "--admission", "static",
            "--admission-cap", str(CAP), "--stats-period-s", "0.25", "--drain-timeout-s",
            str(DRAIN_TIMEOUT_S), "--checkpoint-interval-s", "0",
            # two replicas, Ray and the clients share 2 cores: a frame's deadline and the
            # audio a session may leave unanswered (1 s, 4 s on the reference host) scale
            # with the host (`tests.host_speed`; a Zen 1-class host once overflowed 4 s)
            "--deadline-fraction", f"{deadline_fraction(1.0):.2f}",
            "--max-buffered-audio-s", f"{4.0 * host_slowness():.2f}"]
    with launched_cluster(tmp_path_factory, args, 2, 60) as (url, printed):
        yield url, ray_address(printed)


def settle(launched, every_listed: bool) -> str:
    """The cluster's URL once two live replicas report no session, whatever ran before: a
    replica scaled away is scaled back, a killed one's replacement waited for. With
    `every_listed`, also until a killed replica no longer shows in the view (it is listed
    `unreachable` until FORGET_AFTER_S after its last report)."""
    from metronome.cluster.replica import FORGET_AFTER_S

    url, address = launched
    if len(live(url)) < 2:
        scale(address, 2)  # a no-op while Ray replaces a killed replica
    wait_for(lambda: len(live(url)) == 2 and live_actives(url) == [0, 0], 120,
             "two live replicas, idle")
    if every_listed:
        wait_for(lambda: [r["status"] for r in view(url)["replicas"]] == ["ok", "ok"],
                 FORGET_AFTER_S + 30, "only the two live replicas listed")
    return url


@pytest.fixture
def cluster(launched):
    """Two idle replicas and no other listed."""
    return settle(launched, every_listed=True)


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
        # the board has the close; the router's own stats may be a report behind it
        sessions.append(open_session_retrying(ws_url))
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


async def _sdk_duplex(url: str) -> list:
    """The official SDK's realtime client, as in test_serve_integration (no key here; the
    tiny model has no tokenizer: frames and responses, no text)."""
    client = AsyncOpenAI(api_key="unused", websocket_base_url=url.replace("http", "ws") + "/v1")
    async with client.realtime.connect(model="metronome") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={
            "type": "realtime", "output_modalities": ["text"],
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}})
        assert (await conn.recv()).type == "session.updated"
        pcm = speech_stream(SPEECH_DIR, 24000, 2.0)
        for offset in range(0, len(pcm), 9600):  # 100 ms appends at real-time pace
            await conn.input_audio_buffer.append(
                audio=base64.b64encode(pcm[offset: offset + 9600]).decode())
            await asyncio.sleep(0.1)
        events = []
        while sum(e.type == "response.done" for e in events) < 2:
            events.append(await asyncio.wait_for(conn.recv(), 30))
        return events


def test_openai_sdk_realtime_client_through_the_cluster_entry_point(launched):
    events = asyncio.run(_sdk_duplex(settle(launched, every_listed=False)))
    done = [e for e in events if e.type == "response.done"]
    assert [d.response.status for d in done] == ["completed", "completed"]
    assert [e.type for e in events].count("response.created") == 2


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


def test_scale_2_to_1_drains_a_replica_until_its_drain_timeout(launched):
    url, address = settle(launched, every_listed=False), launched[1]
    ws_url = url.replace("http", "ws") + "/v1/realtime"
    streamers = []
    for on_each in ([0, 1], [1, 1]):  # the second after the first is reported: the other
        streamers.append(DrainedStreamer(ws_url))
        streamers[-1].frames = Stamped()
        streamers[-1].start()
        wait_for(lambda on_each=on_each: live_actives(url) == on_each, 10,
                 f"sessions {on_each}")
    scale(address, 1)
    draining = wait_for(lambda: [r for r in live(url).values() if r["draining"]], 10,
                        "a replica draining")[0]
    seen_at_s = time.monotonic()
    assert draining["active_sessions"] == 1
    late = [open_session(ws_url) for _ in range(CAP - 1)]  # new sessions: the other one
    try:
        wait_for(lambda: sum(live_actives(url)) == 1 + CAP, 5, "the new sessions reported")
        assert live(url)[draining["replica"]]["active_sessions"] == 1  # none of them
        cut = wait_for(lambda: [s for s in streamers if s.closed_at_s], DRAIN_TIMEOUT_S + 5,
                       "the drain timeout's close")
        assert len(cut) == 1
        cut, kept = cut[0], next(s for s in streamers if s is not cut[0])
        assert (cut.ws.close_code, cut.ws.close_reason) == (1001,
                                                            "server draining: drain timeout")
        # not cut before the drain timeout (seen draining up to a drain check late), and
        # served all along: a frame result each second up to the close
        assert cut.closed_at_s - seen_at_s >= DRAIN_TIMEOUT_S - 1.5
        assert cut.frames_after(seen_at_s) >= DRAIN_TIMEOUT_S - 2
        assert [e["code"] for e in cut.errors] == ["server_draining"]
        wait_for(lambda: draining["replica"] not in live(url), 15, "the drained one gone")
        time.sleep(1.5)
        assert kept.closed_at_s is None and kept.frames_after(cut.closed_at_s) >= 1
        assert not kept.late_frames and kept.errors == []
    finally:
        for ws in late:
            ws.close()
        for streamer in streamers:
            streamer.stop()
