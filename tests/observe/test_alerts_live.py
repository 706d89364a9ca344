"""A real Prometheus scraping a live `metronome serve` on loopback while unbounded sessions
fill a small KV pool: the silent-cliff alert fires, and every dashboard query returns series.

The server runs the bundled SmolLM2 with `--policy unbounded --pool-tokens 512 --admission
off`; two `metronome load` clients stream speech (12.5 audio tokens + 4 output tokens a
second each), so the 32-block pool is full after ~16 s and every frame after that goes out
on time but empty. (Two, not more: SmolLM2 in float32 on a 2-core CPU without native bf16
already runs 4 sessions late, and the test is about the silent failure, not overload.)
Prometheus scrapes every second and evaluates the rules every second,
with 10 s rate windows and 5 s `for` (tests/prom.py FAST). Set METRONOME_RECORD_CLIFF=PATH to
also write the recorded series (the fixture tests/observe/test_alerts.py replays with promtool).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from metronome.observe.alerts import alert_rules
from metronome.observe.dashboard import queries
from metronome.observe.promql import metric_names
from metronome.serve.config import ServerConfig
from tests import prom
from tests.served import TEXT_DUPLEX, free_port, served

pytestmark = pytest.mark.wall_clock

LOAD_S = 35.0
SESSIONS = 2
POOL_TOKENS = 512


@pytest.mark.model
def test_silent_cliff_alert_fires_against_a_live_server(tmp_path):
    prom.need("prometheus")
    config = ServerConfig(**TEXT_DUPLEX,
                          policy="unbounded", pool_tokens=POOL_TOKENS, admission="off")
    with served(config) as url:
        target = url.removeprefix("http://")
        with prom.prometheus(tmp_path, target, free_port()) as prometheus_url:
            timeline, started_s, ended_s = _drive_the_cliff(url, prometheus_url, tmp_path)
            print(json.dumps(timeline, indent=1))
            assert "MetronomeSilentCliff" in timeline["firing"], timeline
            assert "MetronomeKvStalls" in timeline["firing"], timeline
            # (MetronomeDeadlineMisses may fire on a loaded machine: not the point here)
            for alert in ("MetronomeEngineNotStepping", "MetronomeDown",
                          "MetronomeAdmissionRefusing"):
                assert alert not in timeline["firing"], timeline
            empty = _queries_without_series(prometheus_url, started_s, time.time())
            assert not empty, empty
            record = os.environ.get("METRONOME_RECORD_CLIFF")
            if record:
                labels = {"instance": target, "job": prom.FAST.job}
                _record(prometheus_url, timeline, labels, started_s, ended_s, Path(record))


def _drive_the_cliff(url: str, prometheus_url: str, folder: Path):
    """Run the load clients; poll the alerts every second until the load ends."""
    load = subprocess.Popen(
        [str(Path(sys.executable).with_name("metronome")), "load", "--url",
         url.replace("http://", "ws://") + "/v1/realtime", "--sessions", str(SESSIONS),
         "--ramp-s", "1", "--duration-s", str(LOAD_S), "--out", str(folder / "load")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started_s = time.time()
    timeline = {"pending": {}, "firing": {}}
    grace_s = None  # after the load: a slow machine's last rates still hold for a window
    try:
        while True:
            assert time.time() - started_s < LOAD_S + 60, "the load clients did not finish"
            for name, state in prom.firing_alerts(prometheus_url).items():
                timeline[state].setdefault(name, round(time.time() - started_s, 1))
            if load.poll() is not None:
                if grace_s is None:
                    fired = "MetronomeSilentCliff" in timeline["firing"]
                    grace_s = time.time() + (2 if fired else 8)
                if time.time() >= grace_s:
                    break
            time.sleep(1)
    finally:
        if load.poll() is None:
            load.kill()
        load.wait(timeout=10)
    summary = json.loads((folder / "load" / "summary.json").read_text())
    timeline["load"] = {k: summary[k] for k in ("frames", "frames_by_status", "goodput_server")}
    return timeline, started_s, time.time()


def _queries_without_series(prometheus_url: str, start_s: float, end_s: float) -> list[str]:
    empty = []
    for expr in queries():
        promql = expr.replace("$__rate_interval", prom.FAST.window)
        data = prom.api(prometheus_url, "query_range", query=promql, start=start_s,
                        end=end_s, step=1)
        if not data["result"]:
            empty.append(promql)
    return empty


def _record(prometheus_url: str, timeline: dict, labels: dict, start_s: float, end_s: float,
            path: Path) -> None:
    """The series the alert rules read, second by second, as a promtool fixture."""
    names = set().union(*(metric_names(r.expr) for r in alert_rules(prom.FAST))) - {"up"}
    series = prom.record_series(prometheus_url, sorted(names), int(start_s), int(end_s))
    path.write_text(json.dumps({
        "recorded": "tests/observe/test_alerts_live.py (METRONOME_RECORD_CLIFF)",
        "labels": labels, "healthy_at_s": 8,
        "cliff_at_s": round(timeline["firing"]["MetronomeSilentCliff"]) + 2,
        "series": series}, indent=1) + "\n")
