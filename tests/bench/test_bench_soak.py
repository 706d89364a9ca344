"""`metronome bench soak --duration-s 6`: the soak runs end to end against a real
`metronome serve` subprocess and writes its verdict, JSON, report and plot. Checks structure
and the idle-end facts (every block back, no fd left open), not timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def test_bench_soak_smoke(tmp_path):
    md, js = tmp_path / "soak.md", tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-c", "from metronome.cli import app; app()", "bench", "soak",
         "--duration-s", "6", "--sample-s", "1", "--sessions", "2", "--out", str(js)],
        capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(js.read_text())
    phases = [s["phase"] for s in result["samples"]]
    assert phases[:3] == ["idle_start"] * 3 and phases[-3:] == ["idle_end"] * 3
    assert "load" in phases
    verdict = result["verdict"]
    assert verdict["blocks"]["used_when_idle_at_end"] == 0 and verdict["blocks"]["flat"]
    assert verdict["fds"]["flat"], verdict["fds"]
    assert result["clients"]["sessions"].get("good:completed", 0) >= 1
    assert any(k.startswith("bad_") for k in result["clients"]["sessions"])
    text = md.read_text()
    # the command as run (no "nice -n 19" the run did not have: the report says the nice level
    # it measured)
    assert "metronome bench soak --duration-s 6" in text and "Machine:" in text
    assert f"ran at nice {result['provenance']['nice']}" in text
    assert (tmp_path / "soak.png").stat().st_size > 1000
