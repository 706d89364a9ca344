"""`metronome bench engine-paths`: the engine's fast path against its reference path, side
by side: before and after the paged kernel and the prepacked projections.

Fast = the defaults (paged-attention kernel for decode, oneDNN on prepacked weights);
reference = dense attention (gather + padded, masked SDPA) and `F.linear`, the engine as it
was before. For each N x L and each policy (unbounded, sinks 4 + window 512) both run the
same decode step (N sessions of L tokens of synthetic history, `metronome bench engine`'s
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
PATHS = ("reference", "fast")


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

    @classmethod
    def smoke(cls) -> Config:
        return cls(sessions=(2,), lengths=(128,), policies=("unbounded", "sinks_window:4:32"),
                   repeats=2)


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.bench.engine.facts import BUNDLED_MODEL, dtype_name, engine_path
    from metronome.bench.engine.ours import OursRun
    from metronome.bench.engine.plan import Config as EngineConfig
    from metronome.bench.engine.timing import time_interleaved
    from metronome.kv.residency import ResidencyPolicy
    from metronome.model.dtypes import resolve_dtype
    from metronome.model.weights import load_model

    dtype = resolve_dtype("auto")
    models = {path: load_model("bundled", dtype) for path in PATHS}
    ctx.record(model=BUNDLED_MODEL, dtype=dtype_name(dtype),
               engine_path=" vs ".join(engine_path(p, models[p]) for p in PATHS))
    # the engine bench's workload (OursRun) at this bench's repeats
    plan = replace(EngineConfig(), repeats=cfg.repeats, warmup_steps=cfg.warmup_steps)
    cells = [(length, n, spec) for length in cfg.lengths for n in cfg.sessions
             for spec in cfg.policies if n * length <= cfg.max_cell_tokens]
    rows = []
    with ctx.progress("cells", len(cells)) as advance:
        for length, n, spec in cells:
            policy = ResidencyPolicy.parse(spec)
            runs = {path: OursRun(models[path], policy, n, length, plan, engine_path=path)
                    for path in PATHS}
            try:
                timed = time_interleaved({p: r.step for p, r in runs.items()},
                                         plan.warmup_steps, cfg.repeats)
                profiles = {p: r.detail()["profile"] for p, r in runs.items()}
            finally:
                for r in runs.values():
                    r.close()
            for path in PATHS:
                rows.append({"path": path, "policy": spec, "sessions": n,
                             "context_tokens": length,
                             "step_ms_median": timed[path]["step_ms_median"],
                             "step_ms_min": timed[path]["step_ms_min"],
                             "tokens_per_s": n / timed[path]["step_ms_median"] * 1e3,
                             "profile": profiles[path]})
            ctx.keep("rows", rows)
            ref, fast = (timed[p]["step_ms_median"] for p in PATHS)
            ctx.log(f"{spec} N={n} L={length}: reference {ref:.1f} ms, fast {fast:.1f} ms "
                    f"({ref / fast:.2f}x)")
            advance()
    return {"config": asdict(cfg), "rows": rows}


def _pct(share: float) -> str:
    return f"{share:.0%}"


def report(result: dict) -> str:
    cfg, rows = result["config"], result["rows"]
    by = {(r["path"], r["policy"], r["sessions"], r["context_tokens"]): r for r in rows}
    keys = sorted({k[1:] for k in by}, key=lambda k: (k[0], k[2], k[1]))
    step_rows = []
    for policy, n, length in keys:
        ref, fast = by[("reference", policy, n, length)], by[("fast", policy, n, length)]
        step_rows.append([policy, n, f"{length:,}",
                          f"{ref['step_ms_median']:.1f} / {ref['step_ms_min']:.1f}",
                          f"{fast['step_ms_median']:.1f} / {fast['step_ms_min']:.1f}",
                          f"**{ratio(ref['step_ms_median'], fast['step_ms_median'])}**"])
    profile_rows = []
    for policy, n, length in keys:
        for path in PATHS:
            p = by[(path, policy, n, length)]["profile"]
            s = p["share_of_wall"]
            profile_rows.append([policy, n, f"{length:,}", path, f"{p['wall_ms']:.0f}",
                                 f"{p['aten_calls_per_step']:.0f}", _pct(s["matmul"]),
                                 _pct(s["attention"]), _pct(s["copy_gather"]),
                                 _pct(s["other_aten"]), _pct(p["outside_aten_share"])])
    lines = [
        f"# The engine's fast path vs its reference path (`{result['command']}`)", "",
        f"Written by the command in {result['elapsed_s'] / 60:.0f} min; do not edit by hand.",
        "", describe(result["provenance"]), "",
        "**Workload**: one decode step of N sessions of L tokens each (synthetic history, "
        "random K/V: `metronome bench engine`'s workload), block size 16. Reference = dense "
        "attention (gather every session's blocks into a scratch, pad, masked SDPA) and "
        "`F.linear`, the engine before its fast path; fast = the paged-attention kernel and "
        f"oneDNN on prepacked weights. Both interleaved round-robin, {cfg['repeats']} timed "
        f"steps each after {cfg['warmup_steps']} warm-up steps; then one profiled step pair "
        "each.", "",
        "## Step time", "",
        md_table(["policy", "N", "L", "reference ms (median / min)", "fast ms (median / min)",
                  "speed-up"], step_rows), "",
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
