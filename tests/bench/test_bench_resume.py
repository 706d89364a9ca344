"""`metronome bench resume --smoke`: the bench runs end to end and writes its fields (their
values are the benchmark's business, not a test's)."""

from __future__ import annotations

import json

import pytest

from metronome.bench import resume_bench
from metronome.results.context import RunContext, execute

pytestmark = pytest.mark.model


def test_bench_resume_smoke(tmp_path):
    js = tmp_path / "resume.json"
    ctx = RunContext(resume_bench.NAME, js, command="metronome bench resume --smoke")
    execute(resume_bench, ctx, resume_bench.Config.smoke())
    res = json.loads(js.read_text())
    assert [c["model"] for c in res["computed"]] == [
        "bundled", "preset:moshi-7b", "preset:qwen2.5-omni-7b"]
    measured, bundled = res["measured"], res["computed"][0]
    assert measured["kv_bytes"] == bundled["bytes"] < measured["bytes"]  # KV + header
    assert set(measured["stages"]) == {"take", "to_bytes", "from_bytes", "restore"}
    assert res["step_cost"]["step_plain"]["n"] == res["step_cost"]["rounds"] == 2
    assert res["server_resume"]["client"]["n"] == 3
    assert res["server_resume"]["server_histogram"]["count"] == 3
    other = res["other_server_resume"]  # through the store, to the server not holding it
    assert other["store"] == "memory" and other["client"]["n"] == 3
    assert other["server_histogram"]["count"] == 3
    assert other["checkpoints"]["count"] >= 1
    assert other["checkpoint_bytes"] > 100_000  # KV blocks, not only the session state
    assert res["plots"] == ["resume.png"] and (tmp_path / "resume.png").is_file()
    text = (tmp_path / "resume.md").read_text()
    assert "`metronome bench resume --smoke`" in text and "preset:moshi-7b" in text
