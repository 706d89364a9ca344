"""The virtual clock's step cost model (`runtime.cost_model.StepCostModel`) fitted from the
bench's results, and where a run writes it (beside its JSON)."""

from __future__ import annotations

from pathlib import Path

from metronome.bench.engine.plan import HF_SYSTEM
from metronome.sim.cost_model import Calibration, StepCostModel


def fit_step_cost(results: dict, results_path: str | Path) -> tuple[StepCostModel, Calibration]:
    """Fit from the bench's results (as in engine.json, read from `results_path`): our decode
    steps (not transformers'), in the dtype the bench chose: input tokens = N, context =
    N x attended keys per session, step time = the median step."""
    dtype = results["dtype"]["chosen"]
    samples = [
        (row["sessions"], row["sessions"] * row["attended_tokens"], row["step_ms_median"] / 1e3)
        for row in results["grid"]
        if row.get("status") == "ok" and row["system"] != HF_SYSTEM
        and row.get("dtype", dtype) == dtype
    ]
    if len(samples) < 3:
        raise ValueError(f"{results_path}: too few engine rows to fit a cost model")
    m = results["machine"]
    command = results["command"] + (" --smoke" if results["smoke"] else "")
    calibration = Calibration(source=f"{results_path} ({command})",
                              machine=f"{m['cpu_model']}, {m['logical_cpus']} logical CPUs",
                              date=f"{results['finished_utc']} UTC", dtype=dtype)
    return StepCostModel.fit(samples), calibration


def step_cost_path(results_path: str | Path) -> Path:
    """Where a run whose JSON goes to `results_path` writes its cost model."""
    path = Path(results_path)
    return path.with_name(f"{path.stem}_step_cost.json")
