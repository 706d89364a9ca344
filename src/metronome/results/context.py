"""The run context every bench and experiment gets: where it writes, how big it runs, how it
shows progress, what it records about where it ran, and what survives an interrupt.

    ctx = RunContext("engine", out_json=Path("docs/results/engine.json"), scale=Scale.FULL)
    result = execute(module, ctx, cfg)    # module.run(ctx, cfg), then module.report(result)

`execute` writes the JSON (the common fields, the provenance and the run's own result) and
the markdown report; figures go beside the report. A run keeps its finished pieces with
`ctx.keep(key, value)`; if it is interrupted (Ctrl-C or an error) those pieces are written to
`<name>.partial.json` beside the JSON before the error propagates, so hours of measurement are
never lost to the last cell.
"""

from __future__ import annotations

import enum
import json
import random
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from metronome.results.provenance import provenance

# Keys every result JSON has, whatever the bench or experiment.
COMMON_FIELDS = ("name", "scale", "seed", "elapsed_s", "plots", "command", "provenance")


class Scale(enum.StrEnum):
    SMOKE = "smoke"  # minutes: shapes only, for CI
    FULL = "full"  # the numbers in docs/results/


@dataclass
class RunContext:
    name: str
    out_json: Path  # the result; the report is `out_md`, figures go beside it
    out_md: Path | None = None  # default: out_json with .md
    scale: Scale = Scale.SMOKE
    seed: int = 0
    command: str = field(default_factory=lambda: shlex.join(["metronome", *sys.argv[1:]]))
    console: Console = field(default_factory=lambda: Console(stderr=True))
    started_s: float = field(default_factory=time.perf_counter)
    plots: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # dtype, engine path, model: see `record`
    kept: dict = field(default_factory=dict)  # finished pieces, written on interrupt

    def __post_init__(self) -> None:
        self.out_json = Path(self.out_json)
        self.out_md = self.out_json.with_suffix(".md") if self.out_md is None else Path(
            self.out_md)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.out_json.parent.mkdir(parents=True, exist_ok=True)
        self.scale = Scale(self.scale)
        random.seed(self.seed)
        import torch

        torch.manual_seed(self.seed)

    @property
    def out_dir(self) -> Path:
        """Where figures go: beside the report."""
        return self.out_md.parent

    @property
    def full(self) -> bool:
        return self.scale is Scale.FULL

    def log(self, message: str) -> None:
        self.console.print(message)

    def record(self, **facts) -> None:
        """Facts of this run that a reader needs to compare it: dtype, engine path, model."""
        self.facts.update(facts)

    def keep(self, key: str, value) -> None:
        """A finished piece of the result, written to the partial JSON if the run dies."""
        self.kept[key] = value

    @contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[Callable]:
        """`with ctx.progress("runs", 40) as advance: ... advance()` shows a bar on stderr
        (total None: a count with no end known in advance, e.g. a bisection)."""
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=self.console, transient=False) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)

    def figure(self, name: str):
        """pyplot and a `save(fig)` that writes `fig` as `name` and lists it in the result."""
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
        """For code that saves its own figure: the path, listed in the result's plots."""
        self.plots.append(name)
        return self.out_dir / name

    def common(self) -> dict:
        return {"name": self.name, "scale": str(self.scale), "seed": self.seed,
                "elapsed_s": round(time.perf_counter() - self.started_s, 1),
                "plots": list(self.plots), "command": self.command,
                "provenance": provenance(**self.facts)}

    def finish(self, result: dict, report: Callable[[dict], str]) -> dict:
        """Write the JSON (common fields + `result`) and `report(full)` as the markdown."""
        full = self.common() | result
        self.out_json.write_text(json.dumps(full, indent=2, default=_plain))
        self.out_md.write_text(report(full))
        self.log(f"[bold]{self.name}[/bold]: wrote {self.out_json}, {self.out_md.name} and "
                 f"{len(self.plots)} plot(s) in {full['elapsed_s']:.0f} s")
        return full

    def write_partial(self, reason: str) -> Path:
        path = self.out_json.with_name(self.out_json.stem + ".partial.json")
        partial = self.common() | {"interrupted": reason} | self.kept
        path.write_text(json.dumps(partial, indent=2, default=_plain))
        self.log(f"[yellow]{self.name}[/yellow]: interrupted ({reason}); kept "
                 f"{', '.join(self.kept) or 'nothing'} in {path}")
        return path


class RunRefused(Exception):
    """A run refused before it did any work (what it asks for cannot run on this machine):
    the command says why and exits, no partial result is written."""


def execute(module, ctx: RunContext, cfg) -> dict:
    """`module.run(ctx, cfg)` then `ctx.finish(result, module.report)`; on an interrupt or an
    error the pieces kept so far go to the partial JSON and the error propagates."""
    try:
        result = module.run(ctx, cfg)
    except RunRefused:
        raise
    except BaseException as err:  # Ctrl-C included: that is when the partial matters most
        ctx.write_partial(type(err).__name__ + (f": {err}" if str(err) else ""))
        raise
    return ctx.finish(result, module.report)


def _plain(value):
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON: {type(value).__name__}")
