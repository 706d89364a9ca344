"""The paper's results, one command each: `metronome experiment {cliff, admission, predict,
quality, all}`. Each is a module of the bench shape (`NAME`, `Config` with `.smoke()`,
`run(ctx, cfg)`, `report(result)`) on the shared `metronome.results` run context; see
`common` for what every experiment's summary.json adds."""

from __future__ import annotations

import importlib

EXPERIMENTS = ("cliff", "admission", "predict", "quality")


def module(name: str):
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}")
    return importlib.import_module(f"metronome.experiments.{name}")
