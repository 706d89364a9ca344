"""What every experiment shares: where it writes, how big it runs, how it shows progress.

An experiment is a module with `NAME`, `REQUIRED_FIELDS` (the keys its summary.json always
has, checked in CI) and `run(ctx) -> dict`. It writes into `ctx.out_dir`:
`summary.json` (via `ctx.finish`), PNG plots (via `ctx.figure`), and `report.md`.
"""

from __future__ import annotations

import enum
import json
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel

# Keys every summary.json has, whatever the experiment.
COMMON_FIELDS = ("experiment", "scale", "seed", "clock", "elapsed_s", "plots", "command")


class Scale(enum.StrEnum):
    SMOKE = "smoke"  # minutes for all four together; shapes only, for CI
    FULL = "full"  # the numbers in docs/results/paper.md


@dataclass
class ExperimentContext:
    out_dir: Path
    scale: Scale = Scale.SMOKE
    seed: int = 0
    console: Console = field(default_factory=lambda: Console(stderr=True))
    started_s: float = field(default_factory=time.perf_counter)
    plots: list[str] = field(default_factory=list)
    step_cost: Path | None = None  # virtual-clock calibration file; None: the packaged one

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        random.seed(self.seed)
        torch.manual_seed(self.seed)

    @property
    def full(self) -> bool:
        return self.scale is Scale.FULL

    def log(self, message: str) -> None:
        self.console.print(message)

    @contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[callable]:
        """`with ctx.progress("runs", 40) as advance: ... advance()` shows a bar on stderr
        (total None: a count with no end known in advance, e.g. a bisection)."""
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=self.console, transient=False) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)

    def figure(self, name: str):
        """pyplot and a `save(fig)` that writes `fig` as `name` and lists it in the summary."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = self.out_dir / name

        def save(fig) -> None:
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            self.plots.append(name)

        return plt, save

    def plot_path(self, name: str) -> Path:
        """For code that saves its own figure: the path, listed in the summary's plots."""
        self.plots.append(name)
        return self.out_dir / name

    def finish(self, experiment: str, clock: str, summary: dict, report_md: str) -> dict:
        """Write summary.json (common fields + `summary`) and report.md; returns the summary."""
        full = {
            "experiment": experiment, "scale": str(self.scale), "seed": self.seed,
            "clock": clock, "elapsed_s": round(time.perf_counter() - self.started_s, 1),
            "plots": list(self.plots),
            "command": f"metronome experiment {experiment} --scale {self.scale} "
                       f"--seed {self.seed} --out {self.out_dir}",
        } | summary
        (self.out_dir / "summary.json").write_text(json.dumps(full, indent=2, default=_plain))
        (self.out_dir / "report.md").write_text(report_md)
        self.log(f"[bold]{experiment}[/bold]: wrote {self.out_dir}/summary.json, report.md "
                 f"and {len(self.plots)} plot(s) in {full['elapsed_s']:.0f} s")
        return full


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


def _plain(value):
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def fmt(value, spec: str = ".3g") -> str:
    """A table cell: '-' for None."""
    return "-" if value is None else format(value, spec)
