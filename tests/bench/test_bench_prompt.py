"""`metronome bench prompt --smoke`: the bench runs end to end through two real servers (a
frame's chunk and the large prefill chunks) and writes its fields; timings are its business."""

from __future__ import annotations

import json

import pytest

from metronome.bench import prompt_bench
from metronome.results.context import RunContext, execute

pytestmark = pytest.mark.model


def test_bench_prompt_smoke(tmp_path):
    js = tmp_path / "prompt.json"
    ctx = RunContext(prompt_bench.NAME, js, command="metronome bench prompt --smoke")
    execute(prompt_bench, ctx, prompt_bench.Config.smoke())
    res = json.loads(js.read_text())
    assert [row["prefill_chunk_tokens"] for row in res["rows"]] == [64, 256]
    assert all(len(row["samples_s"]) == 1 and row["min_s"] > 0 for row in res["rows"])
    assert 150 <= res["prompt_tokens"] <= 200
    text = (tmp_path / "prompt.md").read_text()
    assert "`metronome bench prompt --smoke`" in text and "| 256 |" in text
    assert (tmp_path / "prompt.png").stat().st_size > 1000  # named after --out
