"""`metronome bench runtime`: the beat on the wall clock with the bundled SmolLM2.

For N sessions (Hamlet text frames) and each policy, one `metronome run`: per-frame latency
p50/p95/max, goodput, deadline-met share, frames by status, and the runtime's own overhead
per step (report building, frame attribution, observers) as a share of engine step time.
The unbounded runs use a pool that fills mid-run, so the silent cliff shows up beside the
bounded runs. The dtype is `auto`; the report says which one it resolved to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.results.tables import fmt, md_table
from metronome.sim.local import RunConfig, run_local
from metronome.workload_defaults import (
    EXPERIMENT_POLICY_SPEC,
    FRAME_PERIOD_S,
    INPUT_TOKENS_PER_FRAME,
    OUTPUT_TOKENS_PER_FRAME,
    POOL_TOKENS,
)

NAME = "runtime"
RUNS_DIR = Path("out/bench-runtime")  # each run's frames.csv and summary.json


@dataclass(frozen=True)
class Config:
    sessions: tuple[int, ...] = field(default=(1, 4, 8, 16, 24), metadata={
        "help": "session counts N to run, each with every policy"})
    duration_s: float = field(default=30.0, metadata={"help": "length of each session"})
    ramp_s: float = field(default=1.0, metadata={"help": "sessions open over this ramp"})
    bounded_policy: str = field(default=EXPERIMENT_POLICY_SPEC, metadata={
        "help": "the bounded runs' policy"})
    bounded_pool_tokens: int = field(default=POOL_TOKENS, metadata={
        "help": "the bounded runs' KV pool"})
    unbounded_pool_tokens: int = field(default=4096, metadata={
        "help": "the unbounded runs' KV pool (fills mid-run)"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(sessions=(1, 2), duration_s=4.0)


def configs(cfg: Config) -> list[RunConfig]:
    runs = []
    for policy, pool_tokens in ((cfg.bounded_policy, cfg.bounded_pool_tokens),
                                ("unbounded", cfg.unbounded_pool_tokens)):
        for n in cfg.sessions:
            runs.append(RunConfig(
                sessions=n, duration_s=cfg.duration_s, ramp_s=cfg.ramp_s,
                frame_period_s=FRAME_PERIOD_S, tokens_per_frame=INPUT_TOKENS_PER_FRAME,
                output_tokens=OUTPUT_TOKENS_PER_FRAME, policy=policy, pool_tokens=pool_tokens,
                clock="wall", out=str(RUNS_DIR / f"{policy.split(':')[0]}-n{n}"),
            ))
    return runs


def row(config: RunConfig, summary: dict) -> dict:
    latency = summary["latency_ms"]
    return {
        "policy": config.policy, "sessions": config.sessions, "pool_tokens": config.pool_tokens,
        "dtype": summary["dtype"], "frames": summary["frames"], "goodput": summary["goodput"],
        "deadline_met": summary["deadline_met_fraction"],
        "p50_ms": latency["p50"], "p95_ms": latency["p95"], "max_ms": latency["max"],
        "stalled_kv": summary["frames_by_status"]["stalled_kv"],
        "late": summary["frames_by_status"]["late"],
        "health": summary["health"]["state"],
        "runtime_share": summary["runtime_overhead"]["runtime_share_of_step"],
        "step_p50_ms": summary["step_ms"]["p50"],
    }


def run(ctx: RunContext, cfg: Config) -> dict:
    runs = configs(cfg)
    rows = []
    with ctx.progress("runtime runs", len(runs)) as advance:
        for config in runs:
            ctx.log(f"{config.policy} N={config.sessions}")
            rows.append(row(config, run_local(config, ctx.console)))
            ctx.keep("rows", rows)
            advance()
    first = runs[0]
    ctx.record(model=first.model, dtype=", ".join(sorted({r["dtype"] for r in rows})),
               engine_path=first.engine_path)
    workload = {"frame_period_s": first.frame_period_s,
                "deadline_s": first.frame_period_s * first.deadline_fraction,
                "input_tokens_per_frame": first.tokens_per_frame,
                "output_tokens_per_frame": first.output_tokens, "ramp_s": first.ramp_s,
                "duration_s": first.duration_s}
    return {"workload": workload, "rows": rows}


HEADERS = ("policy", "pool tokens", "N", "frames", "goodput", "deadline met", "p50 ms",
           "p95 ms", "max ms", "stalled_kv", "late", "health", "runtime share", "step p50 ms")


def report(result: dict) -> str:
    w, prov = result["workload"], result["provenance"]
    rows = [(r["policy"], r["pool_tokens"], r["sessions"], r["frames"], fmt(r["goodput"], ".1%"),
             fmt(r["deadline_met"], ".1%"), fmt(r["p50_ms"], ".0f"), fmt(r["p95_ms"], ".0f"),
             fmt(r["max_ms"], ".0f"), r["stalled_kv"], r["late"], r["health"],
             fmt(r["runtime_share"], ".2%"), fmt(r["step_p50_ms"], ".0f"))
            for r in result["rows"]]
    lines = [
        f"# Runtime on the wall clock ({prov.get('model')}, {prov.get('dtype')})", "",
        describe(prov), "",
        f"Generated by `{result['command']}` in {result['elapsed_s']:.0f} s. Written by the "
        "command; do not edit by hand.", "",
        f"Workload: N sessions open over a {w['ramp_s']:g} s ramp, each "
        f"{w['duration_s']:g} s long: {w['frame_period_s']:g} s frames of "
        f"{w['input_tokens_per_frame']} Hamlet tokens, up to {w['output_tokens_per_frame']} "
        f"output tokens per frame (free-running), deadline {w['deadline_s']:g} s. Latency: "
        "frame complete at the server -> result ready. Goodput: frames that produced their "
        "output within the deadline. Runtime share: the runtime's own time per step (report "
        "building, frame attribution, observers) / engine step time.", "",
        md_table(HEADERS, rows),
    ]
    return "\n".join(lines) + "\n"
