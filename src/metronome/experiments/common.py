"""What every experiment shares beyond the run context (`metronome.results.RunContext`):
the fields its summary.json adds, and the virtual clock's step cost model.

An experiment writes into its --out folder through the run context: `summary.json` (the
JSON), `report.md` (the markdown, from `report(result)`) and PNG plots beside them. Its
result says which experiment it is and which clock it ran on, and has its `REQUIRED_FIELDS`
(checked in CI).
"""

from __future__ import annotations

import sys
from pathlib import Path

from metronome.results import context
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel

# Keys every summary.json has, whatever the experiment.
COMMON_FIELDS = context.COMMON_FIELDS + ("experiment", "clock")
VIRTUAL_CLOCK = "virtual (real engine steps, SmolLM2-fitted step times)"
STEP_COST_HELP = ("virtual-clock step cost model (a `StepCostModel.save` JSON); None: the "
                  "packaged calibration")


def cost_model(path: str | Path | None = None) -> tuple[StepCostModel, str]:
    """The virtual clock's step cost model and where it came from, logged on stderr: the file
    at `path` (written by `StepCostModel.save`, e.g. by `metronome bench engine`), else the
    calibration packaged with metronome."""
    chosen = PACKAGED_STEP_COST if path is None else Path(path)
    if not chosen.is_file():
        hint = " (the package data was not installed)" if path is None else ""
        raise FileNotFoundError(f"step cost model not found: {chosen}{hint}")
    cost, calibration = StepCostModel.load(chosen)
    name = "packaged metronome/sim/step_cost.json" if path is None else str(chosen)
    source = f"{name}: {calibration.describe()}"
    print(f"step cost model: {source}", file=sys.stderr, flush=True)
    return cost, source
