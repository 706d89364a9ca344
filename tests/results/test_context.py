"""The run context's promise: a run that dies keeps what it finished (`<name>.partial.json`
beside the JSON, then the error propagates), and a run that finishes writes JSON + report."""

from __future__ import annotations

import json
import types

import pytest

from metronome.results.context import RunContext, RunRefused, execute


def _bench(run):
    return types.SimpleNamespace(run=run, report=lambda result: f"# {result['name']}\n")


def test_a_run_that_raises_writes_what_it_kept_and_the_error_propagates(tmp_path):
    def run(ctx, cfg):
        ctx.keep("rows", [{"n": 1}, {"n": 2}])
        raise RuntimeError("the third cell ran out of memory")

    ctx = RunContext("demo", tmp_path / "out" / "demo.json", command="metronome bench demo")
    with pytest.raises(RuntimeError, match="third cell"):
        execute(_bench(run), ctx, cfg=None)
    partial = json.loads((tmp_path / "out" / "demo.partial.json").read_text())
    assert partial["rows"] == [{"n": 1}, {"n": 2}]
    assert partial["interrupted"] == "RuntimeError: the third cell ran out of memory"
    assert partial["name"] == "demo" and partial["command"] == "metronome bench demo"
    assert "machine" in partial["provenance"]
    assert not (tmp_path / "out" / "demo.json").exists()  # no result pretends to be whole


def test_a_refused_run_writes_nothing_and_says_why(tmp_path):
    def run(ctx, cfg):
        raise RunRefused("this grid does not fit this machine's memory")

    ctx = RunContext("demo", tmp_path / "out" / "demo.json", command="metronome bench demo")
    with pytest.raises(RunRefused, match="does not fit"):
        execute(_bench(run), ctx, cfg=None)
    assert not (tmp_path / "out" / "demo.partial.json").exists()
    assert not (tmp_path / "out" / "demo.json").exists()


def test_a_finished_run_writes_its_json_and_report(tmp_path):
    def run(ctx, cfg):
        ctx.record(dtype="float32")
        return {"rows": [cfg]}

    ctx = RunContext("demo", tmp_path / "demo.json")
    result = execute(_bench(run), ctx, cfg=7)
    assert json.loads((tmp_path / "demo.json").read_text()) == result
    assert result["rows"] == [7] and result["provenance"]["dtype"] == "float32"
    assert (tmp_path / "demo.md").read_text() == "# demo\n"
    assert not (tmp_path / "demo.partial.json").exists()
