"""`metronome bench engine-paths`: the engine's code paths side by side on `bench engine`'s
decode step: reference (dense attention, `F.linear`: the engine before its fast path), fast
(the defaults) and fast-onednn (fast without the few-row kernel). The first path is the
baseline. Derived number: the last path's speed-up over the first, geometric mean.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from metronome.bench import systems as sy
from metronome.bench.engine.facts import BUNDLED_MODEL, dtype_name, engine_path
from metronome.bench.presets import Knobs, knob
from metronome.bench.steps import geomean, interleave, stats
from metronome.engine.engine import EngineConfig, for_engine_path
from metronome.kv.residency import ResidencyPolicy
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived

NAME = "engine-paths"
PATHS = ("reference", "fast", "fast-onednn")


@dataclass(frozen=True)
class Config(Knobs):
    sessions: tuple[int, ...] = knob((8, 32, 64), "sessions decoding in one step (N)")
    lengths: tuple[int, ...] = knob((1024, 4096), "tokens of history per session (L)")
    policies: tuple[str, ...] = knob(("unbounded", "sinks_window:4:512"), "policies to run")
    max_cell_tokens: int = knob(65536, "cells with N x L over this are skipped")
    repeats: int = knob(6, "timed steps per path and cell, interleaved")
    warmup_steps: int = knob(2, "untimed steps per path first")
    paths: tuple[str, ...] = knob(("reference", "fast"), f"of {', '.join(PATHS)}, the first "
                                  "the baseline")

    def __post_init__(self) -> None:
        if set(self.paths) - set(PATHS) or len(set(self.paths)) != len(self.paths) or len(
                self.paths) < 2:
            raise ValueError(f"paths: two or more distinct of {', '.join(PATHS)}, got "
                             f"{', '.join(self.paths) or 'none'}")

    SMOKE = dict(sessions=(2,), lengths=(128,), policies=("unbounded", "sinks_window:4:32"),
                 repeats=2)


def run(ctx: RunContext, cfg: Config) -> dict:
    models = {path: sy.load_model() for path in cfg.paths}  # each path sets its own up
    base = {p: "reference" if p == "reference" else "fast" for p in cfg.paths}
    def set_up(path: str, model) -> None:  # after the engine set the fast or reference path
        if path == "fast-onednn":
            model.use_packed_linear(model.packed_linear, few_rows=False)

    for path, model in models.items():
        for_engine_path(model, EngineConfig(), base[path])
        set_up(path, model)
    ctx.record(model=BUNDLED_MODEL, dtype=dtype_name(models[cfg.paths[0]].dtype),
               engine_path=" vs ".join(engine_path(p, m) for p, m in models.items()))
    cells = [(spec, n, length) for length in cfg.lengths for n in cfg.sessions
             for spec in cfg.policies if n * length <= cfg.max_cell_tokens]
    steps, rows = cfg.warmup_steps + cfg.repeats, []
    for spec, n, length in cells:
        policy, systems = ResidencyPolicy.parse(spec), {}
        for path, model in models.items():
            engine = sy.native(model, sy.pool_tokens(policy, n, length, steps), path=base[path])
            set_up(path, model)
            systems[path] = sy.Decode(engine, sy.open_sessions(engine, n, policy, length), steps)
        s = {p: stats(t) for p, t in interleave(systems, cfg.repeats,
                                                warmup=cfg.warmup_steps).items()}
        rows += [{"path": p, "policy": spec, "sessions": n, "context_tokens": length,
                  "step_ms_median": s[p]["median_ms"], "step_ms_min": s[p]["min_ms"],
                  "tokens_per_s": n / s[p]["median_ms"] * 1e3,
                  "speed_up": s[cfg.paths[0]]["median_ms"] / s[p]["median_ms"]}
                 for p in cfg.paths]
        ctx.log(f"{spec} N={n} L={length}: " + ", ".join(
            f"{r['path']} {r['step_ms_median']:.1f} ms" for r in rows[-len(cfg.paths):]))
        ctx.keep("rows", rows)
    last = [r["speed_up"] for r in rows if r["path"] == cfg.paths[-1]]
    return REPORT.finish(ctx, {"config": asdict(cfg), "rows": rows, "derived": derived(
        f"speed-up of {cfg.paths[-1]} over {cfg.paths[0]} (geometric mean over {len(last)} "
        "cells)", geomean(last))})


REPORT = Report("The engine's paths side by side", spec=".2f",
                tables=(Table("Decode step per path (interleaved)", "rows"),))
report = REPORT.markdown
