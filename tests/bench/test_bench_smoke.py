"""`metronome bench engine --smoke` and `engine-paths --smoke`: the benchmarks run end to
end and write their fields.

Checks structure, not values (timings are the benchmark's business, not a test's). The
engine bench measures in a child process of its own (OpenMP's wait policy is set there,
before torch loads), so it runs in this process like any bench.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from metronome.bench import engine_bench, engine_paths
from metronome.results.context import RunContext, execute
from metronome.sim.cost_model import StepCostModel

pytestmark = pytest.mark.model

SYSTEMS = {"unbounded", "sinks_window:4:32", "transformers"}
ROW_FIELDS = {"step_ms_min", "step_ms_median", "tokens_per_s", "resident_tokens_per_session",
              "resident_kv_bytes_per_session", "achieved_flops_per_s", "matmul_ref_flops_per_s"}


def test_bench_engine_smoke(tmp_path):
    md, js = tmp_path / "engine.md", tmp_path / "engine.json"
    ctx = RunContext(engine_bench.NAME, js, command="metronome bench engine --smoke")
    returned = execute(engine_bench, ctx, engine_bench.Config.smoke())
    res = json.loads(js.read_text())
    assert json.loads(json.dumps(returned)) == res  # what the run returns is what it wrote

    assert res["command"] == "metronome bench engine --smoke" and res["scale"] == "smoke"
    assert res["provenance"]["omp_wait_policy"].startswith("PASSIVE")
    assert res["provenance"]["dtype"] == res["dtype"]["chosen"]
    assert res["provenance"]["engine_path"].startswith("fast")
    assert res["dtype"]["chosen"] in {"float32", "bfloat16"}
    assert {r["dtype"] for r in res["dtype"]["rows"]} == {"float32", "bfloat16"}
    assert {r["system"] for r in res["grid"]} == SYSTEMS
    assert len(res["grid"]) == 2 * 2 * len(SYSTEMS)  # N in {1, 4} x L in {64, 256}
    for row in res["grid"] + res["flat"]:
        assert row["status"] == "ok" and ROW_FIELDS <= row.keys()
        assert row["side_by_side_with"]  # smoke sizes always fit together
    assert {r["system"] for r in res["flat"]} == {"sinks_window:4:32"}
    assert {f["system"] for f in res["flatness"]} == SYSTEMS
    assert {r["policy"] for r in res["ratios"]} == {"unbounded", "sinks_window:4:32"}
    assert {o["system"] for o in res["overhead"]} == SYSTEMS
    assert all("bookkeeping_share" in o for o in res["overhead"] if o["system"] != "transformers")
    assert {(w["condition"], w["system"]) for w in res["wait_policy"]} >= {
        ("as found", "sinks_window:4:32"), ("as found", "transformers")}
    assert len(res["goals"]) == 4 and all(isinstance(g["reached"], bool) for g in res["goals"])

    text = md.read_text()
    for heading in ("fp32 vs bf16", "Ours / transformers", "Where the step goes",
                    "Achieved FLOP/s", "OpenMP wait policy", "Goals"):
        assert heading in text
    assert "`metronome bench engine --smoke`" in text
    assert "Step cost model" in text

    model, calibration = StepCostModel.load(tmp_path / "engine_step_cost.json")
    assert model.fixed_s == res["step_cost"]["fixed_s"]
    assert calibration.source == str(js) and calibration.command == res["command"]
    assert calibration.dtype == res["dtype"]["chosen"]
    assert calibration.engine_path == res["provenance"]["engine_path"]


def test_bench_engine_paths_smoke(tmp_path):
    """`metronome bench engine-paths --smoke`: both paths timed and profiled per cell."""
    md, js = tmp_path / "paths.md", tmp_path / "paths.json"
    res = execute(engine_paths, RunContext(engine_paths.NAME, js), engine_paths.Config.smoke())
    assert {(r["path"], r["policy"]) for r in res["rows"]} == {
        (p, s) for p in ("reference", "fast") for s in ("unbounded", "sinks_window:4:32")}
    for row in res["rows"]:
        assert row["step_ms_median"] > 0 and row["profile"]["aten_calls_per_step"] > 0
        assert set(row["profile"]["share_of_wall"]) == {"matmul", "attention", "copy_gather",
                                                        "other_aten"}
    saved = json.loads(js.read_text())["rows"]
    assert [r["step_ms_median"] for r in saved] == [r["step_ms_median"] for r in res["rows"]]
    assert "## Step time" in md.read_text()
    assert res["provenance"]["dtype"] in {"float32", "bfloat16"}


def test_bench_engine_paths_compares_the_few_row_kernel_alone(tmp_path):
    """`--paths fast-onednn --paths fast`: the same fast path with and without the few-row
    projection kernel, the first the baseline; unknown or single paths are refused."""
    from metronome.model import native
    from metronome.model.dtypes import resolve_dtype

    md, js = tmp_path / "few.md", tmp_path / "few.json"
    cfg = replace(engine_paths.Config.smoke(), policies=("sinks_window:4:32",),
                  paths=("fast-onednn", "fast"))
    res = execute(engine_paths, RunContext(engine_paths.NAME, js), cfg)
    assert [r["path"] for r in res["rows"]] == ["fast-onednn", "fast"]
    described = res["provenance"]["engine_path"].split(" vs ")
    kernel = native.small_linear(resolve_dtype("auto")) is not None
    assert [("few-row kernel" in d) for d in described] == [False, kernel]
    assert "speed-up of fast over fast-onednn" in md.read_text()
    for bad in (("fast",), ("fast", "fast"), ("fast", "turbo")):
        with pytest.raises(ValueError, match="paths"):
            replace(cfg, paths=bad)


def test_bench_engine_paths_compares_the_vector_attention_tasks_alone(tmp_path, monkeypatch,
                                                                    paged_kernel):
    """`--paths fast-generic-attention --paths fast`: the same fast path with the paged
    kernel's generic task and with its vectorised ones, interleaved: the kernel's switch is
    off for the generic path's steps only (timed and profiled) and on for the others'."""
    kernel = paged_kernel()
    switch_at_calls: list[bool] = []
    real = kernel.rope_write_attend

    def spied(*args):
        switch_at_calls.append(kernel.vector_tasks())
        return real(*args)

    monkeypatch.setattr(kernel, "rope_write_attend", spied)
    cfg = replace(engine_paths.Config.smoke(), policies=("sinks_window:4:32",),
                  paths=("fast-generic-attention", "fast"))
    res = execute(engine_paths, RunContext(engine_paths.NAME, tmp_path / "g.json"), cfg)
    assert [r["path"] for r in res["rows"]] == ["fast-generic-attention", "fast"]
    assert res["provenance"]["engine_path"].split(" vs ")[0].endswith(
        "with the paged kernel's generic task")
    assert False in switch_at_calls and True in switch_at_calls
    assert kernel.vector_tasks(), "the switch is back on after the run"
