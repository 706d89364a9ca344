"""The live status page in headless Chromium against a real server with streaming sessions:
what the page shows agrees with /metrics. Skips with a message where Chromium is absent
(`make test` installs Debian's chromium)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from served import served

from metronome.serve.config import ServerConfig
from tests.served import TEXT_DUPLEX

pytestmark = [pytest.mark.model, pytest.mark.wall_clock]
STATUSES = ("ok", "late", "stalled_kv", "context_full", "rejected", "cancelled")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def render(url: str, profile_dir: Path, screenshot: Path | None = None) -> str:
    """The page's DOM after its script ran (a few polls), or a screenshot of it."""
    args = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}",
            "--virtual-time-budget=4000", "--window-size=1100,700"]
    args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    done = subprocess.run([*args, url], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def data_value(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}"[^>]*data-value="([^"]*)"', dom)
    assert match, f"#{element_id} not rendered"
    return match.group(1)


def metric(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} not exported")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs "
                    "Debian's chromium package)")
def test_the_status_page_shows_what_metrics_say(tmp_path):
    # 3-period deadlines: the page must show ok frames, and a loaded CI machine answered none
    # of them on time within 30 s with 1 s deadlines
    config = ServerConfig(**TEXT_DUPLEX,
                          policy="sinks_window:4:128", pool_tokens=4096, admission="off",
                          deadline_fraction=3.0)
    with served(config) as url:
        ws_url = url.replace("http", "ws") + "/v1/realtime"
        metronome = str(Path(sys.executable).parent / "metronome")
        load = subprocess.Popen([metronome, "load", "--url", ws_url, "--sessions", "2",
                                 "--ramp-s", "0.2", "--duration-s", "30", "--out",
                                 str(tmp_path / "load")], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while httpx.get(url + "/v1/status").json()["sessions"] == [] or (
                    metric(httpx.get(url + "/metrics").text, "metronome_frames_total",
                           status="ok") < 2):
                assert time.monotonic() < deadline, "no frames answered"
                time.sleep(0.3)
            before = httpx.get(url + "/metrics").text  # the page renders between the two
            dom = render(url + "/status", tmp_path / "chrome")
            text = httpx.get(url + "/metrics").text
            render(url + "/status", tmp_path / "chrome2", tmp_path / "status.png")
        finally:
            load.terminate()  # its sessions lasted past the render (12 s did not, on a
            load.wait(timeout=60)  # busy host: the page showed 0 sessions)
    assert data_value(dom, "status") in {"ok", "degraded", "critical"}
    assert int(data_value(dom, "sessions")) == 2 == metric(text, "metronome_sessions_active")
    frames = [sum(metric(t, "metronome_frames_total", status=s) for s in STATUSES)
              for t in (before, text)]
    assert frames[0] <= int(data_value(dom, "frames")) <= frames[1]
    goodput = sorted(metric(t, "metronome_goodput_ratio") for t in (before, text))
    assert goodput[0] - 0.1 <= float(data_value(dom, "goodput")) <= goodput[1] + 0.1
    used = metric(text, "metronome_kv_pool_blocks", state="used")
    assert abs(int(data_value(dom, "pool")) - used) <= 4  # live: a step may land in between
    strips = re.findall(r'<td class="strip">(.*?)</td>', dom)
    assert len(strips) == 2 and all('class="s-ok"' in strip for strip in strips)
    assert (tmp_path / "status.png").stat().st_size > 5000
