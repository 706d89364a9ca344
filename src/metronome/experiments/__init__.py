"""The paper's results, one command each: `metronome experiment {cliff, admission, predict,
quality, all}`. See `common` for what every experiment writes."""

from __future__ import annotations

import importlib
from pathlib import Path

from metronome.experiments.common import ExperimentContext, Scale

EXPERIMENTS = ("cliff", "admission", "predict", "quality")


def module(name: str):
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"metronome.experiments.{name}")


def run_experiments(names: list[str], out: Path, scale: Scale, seed: int = 0,
                    step_cost: Path | None = None) -> dict[str, tuple[Path, dict]]:
    """Run each named experiment into `out/<name>` (or `out` for a single one); by name,
    the folder it wrote and its summary."""
    done = {}
    for name in names:
        folder = Path(out) / name if len(names) > 1 else Path(out)
        context = ExperimentContext(folder, scale, seed, step_cost=step_cost)
        done[name] = folder, module(name).run(context)
    return done
