"""`metronome experiment NAME`: one of the paper's results (or all), each through the shared
run context: summary.json, report.md and PNG plots in --out (one sub-folder each for `all`)."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import typer


def experiment(
    name: str = typer.Argument(..., help="cliff | admission | predict | quality | all"),
    out: str = typer.Option("out/experiments", help="folder for summary.json, plots, report.md"),
    scale: str = typer.Option("smoke", help="smoke (minutes, CI) | full (docs/results/paper.md)"),
    seed: int = typer.Option(0, help="base seed; every run derives its own from it"),
    step_cost: str = typer.Option(None, help="virtual-clock step cost model (JSON written by "
                                  "`metronome bench engine`, e.g. docs/results/"
                                  "engine_step_cost.json); default: the packaged one",
                                  show_default=False),
) -> None:
    """Reproduce one of the paper's results (or all): writes summary.json, PNG plots and
    report.md into --out (one sub-folder each for `all`)."""
    from metronome.experiments import EXPERIMENTS, module
    from metronome.results.context import RunContext, Scale, execute

    names = list(EXPERIMENTS) if name == "all" else [name]
    if name != "all" and name not in EXPERIMENTS:
        raise typer.BadParameter(f"unknown experiment {name!r}; choose from "
                                 f"{', '.join(EXPERIMENTS)} or all", param_hint="NAME")
    try:
        chosen = Scale(scale)
    except ValueError:
        raise typer.BadParameter(f"choose smoke or full, got {scale!r}",
                                 param_hint="--scale") from None
    if step_cost is not None and not Path(step_cost).is_file():
        raise typer.BadParameter(f"no such file: {step_cost}", param_hint="--step-cost")
    done = {}
    for each in names:
        experiment_module = module(each)
        folder = Path(out) / each if len(names) > 1 else Path(out)
        cfg = (experiment_module.Config.smoke() if chosen is Scale.SMOKE
               else experiment_module.Config())
        if step_cost is not None and "step_cost" in {f.name for f in fields(cfg)}:
            cfg = replace(cfg, step_cost=step_cost)  # the experiments on the virtual clock
        ctx = RunContext(each, out_json=folder / "summary.json", out_md=folder / "report.md",
                         scale=chosen, seed=seed,
                         command=f"metronome experiment {each} --scale {chosen} --seed {seed} "
                                 f"--out {folder}" + (f" --step-cost {step_cost}"
                                                      if step_cost is not None else ""))
        summary = execute(experiment_module, ctx, cfg)
        done[each] = {"out": str(folder), "elapsed_s": summary["elapsed_s"]}
    typer.echo(json.dumps(done, indent=2))
