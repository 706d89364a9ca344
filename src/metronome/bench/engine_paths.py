"""`metronome bench engine-paths`: the engine's fast path against its reference path, side
by side: before and after the paged kernel and the prepacked projections.

Fast = the defaults (paged-attention kernel for decode, oneDNN on prepacked weights, the
few-row projection kernel for steps of at most 8 rows in bf16, 24 in float32, where it
applies); reference = dense
attention (gather + padded, masked SDPA) and `F.linear`, the engine as it was before;
fast-onednn = fast without the few-row kernel (`--paths fast-onednn --paths fast` measures
that kernel alone); fast-generic-attention = fast with the paged kernel's generic task where
a vectorised one would run (bf16 on AVX512-BF16, float32 on AVX2 with FMA: `--paths
fast-generic-attention --paths fast` measures those tasks alone). The first path given is
the baseline of the speed-ups.

For each N x L and each policy (unbounded, sinks 4 + window 512) every path runs the same
decode step (N sessions of L tokens of synthetic history, `metronome bench engine`'s
workload) interleaved round-robin; then one profiled step each (aten calls per step, share of
time in GEMMs, attention, copies, other aten, outside aten). Model: the bundled SmolLM2,
dtype auto (recorded as resolved).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.results.tables import md_table, ratio

NAME = "engine-paths"
PATHS = ("reference", "fast", "fast-onednn", "fast-generic-attention")  # what it can run
FAST_VARIANTS = ("fast-onednn", "fast-generic-attention")  # the fast path, one part swapped


@dataclass(frozen=True)
class Config:
    sessions: tuple[int, ...] = field(default=(8, 32, 64),
                                      metadata={"help": "sessions decoding in one step (N)"})
    lengths: tuple[int, ...] = field(default=(1024, 4096),
                                     metadata={"help": "tokens of history per session (L)"})
    policies: tuple[str, ...] = field(default=("unbounded", "sinks_window:4:512"),
                                      metadata={"help": "residency policies to run"})
    max_cell_tokens: int = field(default=65536, metadata={
        "help": "cells with N x L over this are skipped (memory, time)"})
    repeats: int = field(default=6, metadata={"help": "timed steps per path and cell"})
    warmup_steps: int = field(default=2, metadata={"help": "untimed steps before timing"})
    paths: tuple[str, ...] = field(default=("reference", "fast"), metadata={
        "help": f"engine paths to compare, the first the baseline (of {', '.join(PATHS)})"})

    def __post_init__(self) -> None:
        unknown = [p for p in self.paths if p not in PATHS]
        if unknown or len(set(self.paths)) < 2 or len(set(self.paths)) != len(self.paths):
            raise ValueError(f"paths: two or more distinct of {', '.join(PATHS)}, got "
                             f"{', '.join(self.paths) or 'none'}")

    @classmethod
    def smoke(cls) -> Config:
        return cls(sessions=(2,), lengths=(128,), policies=("unbounded", "sinks_window:4:32"),
                   repeats=2)


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.bench.engine.facts import BUNDLED_MODEL, dtype_name
    from metronome.bench.engine.plan import Config as EngineConfig
    from metronome.bench.engine.timing import time_interleaved
    from metronome.kv.residency import ResidencyPolicy
    from metronome.model.dtypes import resolve_dtype
    from metronome.model.weights import load_model

    dtype = resolve_dtype("auto")
    paths = cfg.paths
    models = {path: load_model("bundled", dtype) for path in paths}
    for path in paths:  # what each path runs with, set up as OursRun will
        models[path].use_packed_linear(path != "reference", few_rows=path != "fast-onednn")
    ctx.record(model=BUNDLED_MODEL, dtype=dtype_name(dtype),
               engine_path=" vs ".join(_described(p, models[p]) for p in paths))
    # the engine bench's workload (OursRun) at this bench's repeats
    plan = replace(EngineConfig(), repeats=cfg.repeats, warmup_steps=cfg.warmup_steps)
    cells = [(length, n, spec) for length in cfg.lengths for n in cfg.sessions
             for spec in cfg.policies if n * length <= cfg.max_cell_tokens]
    rows = []
    with ctx.progress("cells", len(cells)) as advance:
        for length, n, spec in cells:
            policy = ResidencyPolicy.parse(spec)
            runs = {path: _run(models[path], policy, n, length, plan, path) for path in paths}
            try:
                timed = time_interleaved({p: r.step for p, r in runs.items()},
                                         plan.warmup_steps, cfg.repeats)
                profiles = {p: r.detail()["profile"] for p, r in runs.items()}
            finally:
                for r in runs.values():
                    r.close()
            for path in paths:
                rows.append({"path": path, "policy": spec, "sessions": n,
                             "context_tokens": length,
                             "step_ms_median": timed[path]["step_ms_median"],
                             "step_ms_min": timed[path]["step_ms_min"],
                             "tokens_per_s": n / timed[path]["step_ms_median"] * 1e3,
                             "profile": profiles[path]})
            ctx.keep("rows", rows)
            base = timed[paths[0]]["step_ms_median"]
            ctx.log(f"{spec} N={n} L={length}: " + ", ".join(
                f"{p} {timed[p]['step_ms_median']:.1f} ms"
                + ("" if p == paths[0] else f" ({base / timed[p]['step_ms_median']:.2f}x)")
                for p in paths))
            advance()
    return {"config": asdict(cfg), "rows": rows}


def _described(path: str, model) -> str:
    from metronome.bench.engine.facts import engine_path

    described = engine_path(path, model)
    if path == "fast-generic-attention":
        described += " with the paged kernel's generic task"
    return described


def _run(model, policy, n: int, length: int, plan, path: str):
    """The engine bench's workload on `path`: "fast-onednn" is the fast path with the few-row
    projection kernel turned off after OursRun has set the fast path up;
    "fast-generic-attention" the fast path whose steps run the paged kernel's generic task."""
    from metronome.bench.engine.ours import OursRun

    run = OursRun(model, policy, n, length, plan,
                  engine_path="fast" if path in FAST_VARIANTS else path)
    if path == "fast-onednn":
        model.use_packed_linear(True, few_rows=False)
    if path == "fast-generic-attention":
        return _GenericAttention(run)
    return run


class _GenericAttention:
    """An OursRun whose steps, timed and profiled, run the paged kernel's generic task (the
    kernel's switch is process-wide: it is turned off for this run's steps only, so the
    paths interleaved with it keep their vectorised tasks)."""

    def __init__(self, run) -> None:
        from metronome.model import native

        self._run, self._kernel = run, native.kernel()
        if self._kernel is None:
            raise RuntimeError("fast-generic-attention needs the paged kernel: "
                               f"{native.unavailable_reason()}")

    def _generic(self, fn):
        self._kernel.set_vector_tasks(False)
        try:
            return fn()
        finally:
            self._kernel.set_vector_tasks(True)

    def step(self) -> None:
        self._generic(self._run.step)

    def detail(self) -> dict:
        return self._generic(self._run.detail)

    def close(self) -> None:
        self._run.close()


def _pct(share: float) -> str:
    return f"{share:.0%}"


def report(result: dict) -> str:
    cfg, rows = result["config"], result["rows"]
    paths = cfg.get("paths", ("reference", "fast"))
    by = {(r["path"], r["policy"], r["sessions"], r["context_tokens"]): r for r in rows}
    keys = sorted({k[1:] for k in by}, key=lambda k: (k[0], k[2], k[1]))
    step_rows = []
    for policy, n, length in keys:
        cell = [by[(path, policy, n, length)] for path in paths]
        step_rows.append([policy, n, f"{length:,}"]
                         + [f"{c['step_ms_median']:.1f} / {c['step_ms_min']:.1f}" for c in cell]
                         + [f"**{ratio(cell[0]['step_ms_median'], c['step_ms_median'])}**"
                            for c in cell[1:]])
    profile_rows = []
    for policy, n, length in keys:
        for path in paths:
            p = by[(path, policy, n, length)]["profile"]
            s = p["share_of_wall"]
            profile_rows.append([policy, n, f"{length:,}", path, f"{p['wall_ms']:.0f}",
                                 f"{p['aten_calls_per_step']:.0f}", _pct(s["matmul"]),
                                 _pct(s["attention"]), _pct(s["copy_gather"]),
                                 _pct(s["other_aten"]), _pct(p["outside_aten_share"])])
    lines = [
        f"# The engine's paths side by side: {' vs '.join(paths)} (`{result['command']}`)", "",
        f"Written by the command in {result['elapsed_s'] / 60:.0f} min; do not edit by hand.",
        "", describe(result["provenance"]), "",
        "**Workload**: one decode step of N sessions of L tokens each (synthetic history, "
        "random K/V: `metronome bench engine`'s workload), block size 16. Reference = dense "
        "attention (gather every session's blocks into a scratch, pad, masked SDPA) and "
        "`F.linear`, the engine before its fast path; fast = the paged-attention kernel, "
        "oneDNN on prepacked weights and the few-row projection kernel for steps of at "
        "most 8 rows in bf16, 24 in float32, where it applies; fast-onednn = fast without "
        "the few-row kernel; "
        "fast-generic-attention = fast with the paged kernel's generic task where a "
        "vectorised one would run. All "
        f"interleaved round-robin, {cfg['repeats']} timed steps each after "
        f"{cfg['warmup_steps']} warm-up steps; then one profiled step each.", "",
        "## Step time", "",
        md_table(["policy", "N", "L"] + [f"{p} ms (median / min)" for p in paths]
                 + [f"speed-up of {p} over {paths[0]}" for p in paths[1:]], step_rows), "",
        "## Where a step goes (one profiled step)", "",
        md_table(["policy", "N", "L", "path", "profiled ms", "aten calls/step", "matmul",
                  "attention", "copies/gathers", "other aten", "outside aten"], profile_rows),
        "",
        "matmul = the projections' and lm_head's GEMMs; attention = SDPA or the paged kernel "
        "(one span, `metronome::paged_attention`) with every op inside it, and the dense "
        "path's batched score/value matmuls. Profiled steps run slower than timed ones (the "
        "profiler's bookkeeping); the shares describe those steps.", "",
    ]
    return "\n".join(lines)
