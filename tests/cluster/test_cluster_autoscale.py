"""`metronome serve --replicas 1..2` on a local Ray cluster (loopback, the tiny preset model,
static admission of 2 sessions a replica): Ray Serve's autoscaler, with our policy on the
replicas' admission stats, adds a replica when sessions are refused, the refused session
gets in on retry, and once the load leaves it removes one through the drain without
dropping the session still on it. One test: Ray's start and a replica's are the slow part.
"""

from __future__ import annotations

import time

import httpx
import pytest
from websockets.exceptions import InvalidStatus

from tests.cluster.client import (
    DrainedStreamer,
    Stamped,
    launched_cluster,
    live,
    open_session,
    view,
    wait_for,
)
from tests.served import metric

pytest.importorskip("ray.serve", reason="the cluster extra (make install) is not installed")

pytestmark = pytest.mark.wall_clock

CAP = 2  # sessions per replica (static admission)
DOWN_AFTER_S = 4.0  # spare headroom this long removes a replica
SERVED_WHILE_DRAINING_S = 4.0  # the session on the removed replica goes on this long


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory):
    """The cluster's URL and the file its launcher prints to. Headroom 0: only a refusal
    adds a replica, and one wholly free replica (spare >= 0 past one cap) is removed."""
    # Checkpoints off: the removed replica serves its session on while it drains (with them
    # it moves the session to the survivor at once: tests/cluster/test_cluster_resume)
    args = ["--replicas", "1..2", "--model", "preset:tiny", "--admission", "static",
            "--admission-cap", str(CAP), "--stats-period-s", "0.25", "--drain-timeout-s", "60",
            "--autoscale-headroom-sessions", "0", "--autoscale-cooldown-s", "2",
            "--autoscale-down-after-s", str(DOWN_AFTER_S), "--autoscale-refusal-window-s", "6",
            "--autoscale-metrics-period-s", "0.5", "--checkpoint-interval-s", "0"]
    with launched_cluster(tmp_path_factory, args, 1, 60, "autoscale") as (url, printed):
        yield url, printed


def admitted_on_retry(ws_url: str, timeout_s: float) -> tuple[DrainedStreamer, int]:
    """A streaming session, retried after each 503 as its Retry-After says; and the
    refusals it took."""
    deadline, refusals = time.monotonic() + timeout_s, 0
    while True:
        try:
            return DrainedStreamer(ws_url), refusals
        except InvalidStatus as refused:
            assert refused.response.status_code == 503, refused.response.status_code
            refusals += 1
            assert time.monotonic() < deadline, f"still refused after {refusals} tries"
            time.sleep(float(refused.response.headers["Retry-After"]))


def test_refusals_add_a_replica_and_spare_headroom_drains_one_away(autoscaled):
    url, printed = autoscaled
    ws_url = url.replace("http", "ws") + "/v1/realtime"
    (first,) = live(url)
    filling = [open_session(ws_url) for _ in range(CAP)]  # the first replica full
    started_s = time.monotonic()
    streamer, refusals = admitted_on_retry(ws_url, 120)  # refused, retried: admitted
    up_s = time.monotonic() - started_s
    streamer.frames = Stamped()
    streamer.start()
    try:
        assert refusals >= 1
        replicas = wait_for(lambda: len(live(url)) == 2 and live(url), 10, "two replicas")
        second = next(rid for rid in replicas if rid != first)
        wait_for(lambda: [r["active_sessions"] for r in (live(url)[first], live(url)[second])]
                 == [CAP, 1], 5, "the retry on the new replica, reported")
        assert "metronome: autoscaler up: 1 -> 2 replicas" in printed.read_text()

        for ws in filling:  # the load leaves: a whole replica's room is spare
            ws.close()
        drained = wait_for(lambda: live(url).get(second, {}).get("draining"),
                           DOWN_AFTER_S + 15, "the spare replica draining")
        assert drained
        assert view(url)["autoscaling"]["desired_replicas"] == 1
        seen_s = time.monotonic()
        time.sleep(SERVED_WHILE_DRAINING_S)  # its session goes on, served, not cut
        assert streamer.closed_at_s is None and streamer.errors == []
        assert streamer.frames_after(seen_s) >= SERVED_WHILE_DRAINING_S - 1.5
    finally:
        for ws in filling:
            ws.close()
        streamer.stop()  # the client ends it: the drained replica can go
    wait_for(lambda: second not in live(url), 20, "the drained replica gone")
    assert not streamer.late_frames
    text = printed.read_text()
    assert "metronome: autoscaler down: 2 -> 1 replicas" in text
    scrape = type("Server", (), {"url": url})
    assert metric(scrape, "metronome_cluster_autoscale_decisions_total", direction="up") == 1
    assert metric(scrape, "metronome_cluster_autoscale_decisions_total", direction="down") == 1
    assert metric(scrape, "metronome_cluster_autoscale_desired_replicas") == 1
    print(f"scale-up: {up_s:.1f} s from the first refusal to admitted ({refusals} refusals)")
    assert httpx.get(url + "/healthz", timeout=5).status_code == 200
