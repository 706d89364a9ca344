"""The step cost model's file format, the calibration shipped in the package, how
experiments choose a model (explicit file, else packaged: never a silent fallback), and the
engine bench's fit of the model from its rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from metronome.bench.engine.step_cost import calibration, fit_step_cost, step_cost_path
from metronome.experiments.common import cost_model
from metronome.sim.cost_model import PACKAGED_STEP_COST, Calibration, StepCostModel

CALIBRATION = Calibration(source="docs/results/engine.json", machine="Some CPU, 2 logical CPUs",
                          date="2026-11-30 05:18 UTC", dtype="bfloat16",
                          command="metronome bench engine", engine_path="fast (paged kernel)",
                          commit="3b42972")


def test_save_load_round_trips_exactly(tmp_path):
    model = StepCostModel(fixed_s=0.06449299841631537, per_token_s=0.0006471408539974538,
                          per_context_token_s=4.536055433898977e-06)
    path = tmp_path / "nested" / "step_cost.json"
    model.save(path, CALIBRATION)
    assert StepCostModel.load(path) == (model, CALIBRATION)
    assert json.loads(path.read_text())["calibration"]["dtype"] == "bfloat16"


def test_packaged_calibration_loads():
    model, calibration = StepCostModel.load(PACKAGED_STEP_COST)
    assert min(model.fixed_s, model.per_token_s, model.per_context_token_s) > 0
    assert calibration.dtype == "bfloat16"
    assert "docs/results/engine.json" in calibration.source


def test_a_calibration_says_where_what_and_how_it_was_measured(tmp_path):
    text = CALIBRATION.describe()
    for fact in ("docs/results/engine.json", "metronome bench engine", "Some CPU", "bfloat16",
                 "fast (paged kernel)", "3b42972", "2026-11-30 05:18 UTC"):
        assert fact in text
    # a file from before the command, engine path and commit were recorded still loads
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"fixed_s": 1.0, "per_token_s": 2.0, "per_context_token_s": 3.0,
                               "calibration": {"source": "engine.json", "machine": "CPU",
                                               "date": "then", "dtype": "float32"}}))
    model, loaded = StepCostModel.load(old)
    assert model == StepCostModel(1.0, 2.0, 3.0) and loaded.commit is None
    assert "commit unknown" in loaded.describe()


def test_experiments_use_the_packaged_model_unless_given_a_file(tmp_path, capsys):
    packaged, source = cost_model()
    assert packaged == StepCostModel.load(PACKAGED_STEP_COST)[0]
    assert source.startswith("packaged metronome/sim/step_cost.json: ")
    assert source in capsys.readouterr().err  # logged, not silent
    own = tmp_path / "mine.json"
    StepCostModel(1.0, 2.0, 3.0).save(own, CALIBRATION)
    assert cost_model(own) == (StepCostModel(1.0, 2.0, 3.0),
                               f"{own}: {CALIBRATION.describe()}")


def test_a_missing_explicit_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=re.escape(f"step cost model not found: {missing}")):
        cost_model(missing)


def _row(system: str, sessions: int, attended: int, step_ms: float, dtype="bfloat16",
         status="ok") -> dict:
    return {"status": status, "dtype": dtype, "system": system, "sessions": sessions,
            "attended_tokens": attended, "step_ms_median": step_ms}


def test_bench_fit_uses_our_ok_rows_in_the_chosen_dtype_only():
    # step_ms = 10 + 1 * N + 0.01 * N * attended, exactly, for ours in bf16
    ours = [_row("unbounded", n, a, 10 + n + 0.01 * n * a) for n, a in
            [(1, 100), (4, 100), (4, 400), (8, 50)]]
    noise = [_row("transformers", 4, 100, 999.0), _row("unbounded", 4, 100, 999.0, "float32"),
             _row("unbounded", 8, 400, 999.0, status="skipped: memory")]
    model = fit_step_cost(ours + noise, "bfloat16")
    assert model.fixed_s == pytest.approx(0.010, rel=1e-9)
    assert model.per_token_s == pytest.approx(0.001, rel=1e-9)
    assert model.per_context_token_s == pytest.approx(1e-5, rel=1e-9)
    with pytest.raises(ValueError, match="too few engine rows"):
        fit_step_cost(ours[:2] + noise, "bfloat16")


def test_the_bench_calibration_carries_the_run_provenance():
    provenance = {"commit": "abc123-dirty", "dtype": "bfloat16", "engine_path": "fast (x)",
                  "machine": {"cpu_model": "Some CPU", "logical_cpus": 2, "memory_gib": 8}}
    assert calibration("out/engine.json", provenance, "metronome bench engine --smoke",
                       "2026-12-01 10:00 UTC") == Calibration(
        source="out/engine.json", machine="Some CPU, 2 logical CPUs",
        date="2026-12-01 10:00 UTC", dtype="bfloat16", command="metronome bench engine --smoke",
        engine_path="fast (x)", commit="abc123-dirty")


def test_the_bench_writes_its_model_beside_its_json():
    assert step_cost_path("docs/results/engine.json") == Path(
        "docs/results/engine_step_cost.json")
