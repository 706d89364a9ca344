"""The virtual clock's step cost model fitted from the engine bench's rows, its calibration
(where, on what and by which command it was measured), and where a run writes it."""

from __future__ import annotations

from pathlib import Path

from metronome.sim.cost_model import Calibration, StepCostModel


def fit_step_cost(grid: list[dict], dtype: str) -> StepCostModel:
    """Fit from the bench's grid rows: our decode steps (not transformers'), in `dtype`:
    input tokens = N, context = N x attended keys per session, step time = the median step."""
    samples = [
        (row["sessions"], row["sessions"] * row["attended_tokens"], row["step_ms_median"] / 1e3)
        for row in grid
        if row.get("status") == "ok" and row["system"] != "transformers" and row["dtype"] == dtype
    ]
    if len(samples) < 3:
        raise ValueError(f"too few engine rows ({len(samples)}) to fit a cost model")
    return StepCostModel.fit(samples)


def calibration(source: str | Path, provenance: dict, command: str, date: str) -> Calibration:
    """Where a fit came from: the result it was fitted from (`source`), the run's provenance
    (machine, dtype, engine path, commit), the command and when it finished."""
    m = provenance["machine"]
    return Calibration(source=str(source), command=command,
                       machine=f"{m['cpu_model']}, {m['logical_cpus']} logical CPUs",
                       dtype=provenance["dtype"], engine_path=provenance["engine_path"],
                       commit=provenance["commit"], date=date)


def step_cost_path(results_path: str | Path) -> Path:
    """Where a run whose JSON goes to `results_path` writes its cost model."""
    path = Path(results_path)
    return path.with_name(f"{path.stem}_step_cost.json")
