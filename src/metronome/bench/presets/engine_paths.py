"""`metronome bench engine-paths`: the engine's code paths side by side on the same decode
step (`metronome bench engine`'s: N sessions L tokens long, synthetic history).

reference = dense attention and `F.linear` (the engine before its fast path); fast = the
defaults (paged-attention kernel, prepacked oneDNN projections, the few-row kernel where it
applies); fast-onednn = fast without the few-row kernel; fast-generic-attention = fast with
the paged kernel's generic task where a vectorised one would run. `--paths fast-onednn
--paths fast` measures the few-row kernel alone. The first path is the baseline. Derived
number: the last path's speed-up over the first, geometric mean over the cells.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from metronome.bench.presets import knob
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived

NAME = "engine-paths"
PATHS = ("reference", "fast", "fast-onednn", "fast-generic-attention")


@dataclass(frozen=True)
class Config:
    sessions: tuple[int, ...] = knob((8, 32, 64), "sessions decoding in one step (N)")
    lengths: tuple[int, ...] = knob((1024, 4096), "tokens of history per session (L)")
    policies: tuple[str, ...] = knob(("unbounded", "sinks_window:4:512"), "policies to run")
    max_cell_tokens: int = knob(65536, "cells with N x L over this are skipped")
    repeats: int = knob(6, "timed steps per path and cell, interleaved")
    warmup_steps: int = knob(2, "untimed steps per path first")
    paths: tuple[str, ...] = knob(("reference", "fast"), f"paths, the first the baseline "
                                  f"(of {', '.join(PATHS)})")

    def __post_init__(self) -> None:
        if set(self.paths) - set(PATHS) or len(set(self.paths)) != len(self.paths) or len(
                self.paths) < 2:
            raise ValueError(f"paths: two or more distinct of {', '.join(PATHS)}, got "
                             f"{', '.join(self.paths) or 'none'}")

    @classmethod
    def smoke(cls) -> Config:
        return cls(sessions=(2,), lengths=(128,), policies=("unbounded", "sinks_window:4:32"),
                   repeats=2)


class GenericAttention:
    """A decode whose steps run the paged kernel's generic task (the switch is process-wide:
    off for this system's steps only, so the paths interleaved with it keep theirs)."""

    def __init__(self, decode) -> None:
        from metronome.model import native

        self.decode, self.kernel = decode, native.kernel()
        if self.kernel is None:
            raise RuntimeError(f"fast-generic-attention needs the paged kernel: "
                               f"{native.unavailable_reason()}")

    def step(self) -> None:
        self.kernel.set_vector_tasks(False)
        try:
            self.decode.step()
        finally:
            self.kernel.set_vector_tasks(True)


def _set_up(path: str, model) -> None:
    """`path`'s own switch on `model`, after the engine set up the fast or reference path."""
    if path == "fast-onednn":
        model.use_packed_linear(True, few_rows=False)


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.bench.engine.facts import BUNDLED_MODEL, dtype_name, engine_path
    from metronome.bench.steps import geomean, interleave, stats
    from metronome.bench.systems import Decode, load_model, native, open_sessions, pool_tokens
    from metronome.engine.engine import EngineConfig, for_engine_path
    from metronome.kv.residency import ResidencyPolicy

    models = {path: load_model() for path in cfg.paths}  # each path sets its own up
    base = {p: "reference" if p == "reference" else "fast" for p in cfg.paths}
    described = []
    for path, model in models.items():
        for_engine_path(model, EngineConfig(), base[path])
        _set_up(path, model)
        described.append(engine_path(path, model) + (" with the paged kernel's generic task"
                                                      if path == "fast-generic-attention" else ""))
    ctx.record(model=BUNDLED_MODEL, dtype=dtype_name(models[cfg.paths[0]].dtype),
               engine_path=" vs ".join(described))
    cells = [(spec, n, length) for length in cfg.lengths for n in cfg.sessions
             for spec in cfg.policies if n * length <= cfg.max_cell_tokens]
    steps, rows = cfg.warmup_steps + cfg.repeats, []
    with ctx.progress("cells", len(cells)) as advance:
        for spec, n, length in cells:
            policy, systems = ResidencyPolicy.parse(spec), {}
            for path, model in models.items():
                engine = native(model, pool_tokens(policy, n, length, steps), path=base[path])
                _set_up(path, model)
                decode = Decode(engine, open_sessions(engine, n, policy, length), steps)
                systems[path] = (GenericAttention(decode) if path == "fast-generic-attention"
                                 else decode)
            times = {p: stats(t) for p, t in interleave(systems, cfg.repeats,
                                                        warmup=cfg.warmup_steps).items()}
            for path in cfg.paths:
                rows.append({"path": path, "policy": spec, "sessions": n, "context_tokens": length,
                             "step_ms_median": times[path]["median_ms"],
                             "step_ms_min": times[path]["min_ms"],
                             "tokens_per_s": n / times[path]["median_ms"] * 1e3,
                             "speed_up": times[cfg.paths[0]]["median_ms"]
                             / times[path]["median_ms"]})
            ctx.keep("rows", rows)
            advance()
    last = [r["speed_up"] for r in rows if r["path"] == cfg.paths[-1]]
    return REPORT.finish(ctx, {"config": asdict(cfg), "rows": rows, "derived": derived(
        f"speed-up of {cfg.paths[-1]} over {cfg.paths[0]} (geometric mean over {len(last)} "
        "cells)", geomean(last))})


REPORT = Report("The engine's paths side by side", spec=".2f", tables=(
    Table("Decode step per path (interleaved)", "rows", (
        ("path", "path", ""), ("policy", "policy", ""), ("N", "sessions", ""),
        ("L", "context_tokens", ""), ("median ms", "step_ms_median", ".1f"),
        ("min ms", "step_ms_min", ".1f"), ("tokens/s", "tokens_per_s", ".0f"),
        ("speed-up over the first path", "speed_up", ".2f"))),))
report = REPORT.markdown
