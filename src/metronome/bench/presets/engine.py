"""`metronome bench engine`: one batched decode step of N sessions L tokens long under each
residency policy, side by side (`bench.steps`, per N and L), and the virtual clock's step
cost fitted from these rows (beside the JSON as `<name>_step_cost.json`; the packaged
`sim/step_cost.json` is a copy of one). It measures in a fresh process with OpenMP's passive
wait unless the environment chose a policy. Derived number: the unbounded step over the
bounded one at the largest N and L both ran.
"""

from __future__ import annotations

import gc
import os
import statistics
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from metronome.bench import systems as sy
from metronome.bench.engine.facts import BUNDLED_MODEL, dtype_name, engine_path
from metronome.bench.engine.step_cost import calibration, fit_step_cost, step_cost_path
from metronome.bench.presets import Knobs, knob
from metronome.bench.steps import interleave, stats
from metronome.bench.workload import in_fresh_process
from metronome.kv.residency import ResidencyPolicy
from metronome.results.context import RunContext
from metronome.results.provenance import provenance
from metronome.results.report import Plot, Report, Table, derived

NAME = "engine"


@dataclass(frozen=True)
class Config(Knobs):
    sessions: tuple[int, ...] = knob((1, 8, 32, 64), "sessions decoding in one step (N)")
    session_tokens: tuple[int, ...] = knob((1024, 4096, 8192), "tokens of history (L)")
    policies: tuple[str, ...] = knob(("unbounded", "sinks_window:4:512"), "policies, side by side")
    repeats: int = knob(5, "timed steps per policy, interleaved")
    warmup_steps: int = knob(2, "untimed steps per policy first")
    dtype: str = knob("auto", "the bundled model's dtype")
    kv_budget_gib: float = knob(6.0, "a policy whose KV pool exceeds this is skipped")

    SMOKE = dict(sessions=(1, 4), session_tokens=(64, 256),
                 policies=("unbounded", "sinks_window:4:32"), repeats=2, warmup_steps=1,
                 kv_budget_gib=1.0)


def wait_policy(environ) -> dict[str, str]:
    """OpenMP's passive wait for the measuring process unless the environment chose (spinning
    turns a step into seconds while another process holds a core; OpenMP reads it once)."""
    return {} if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(environ) else {
        "OMP_WAIT_POLICY": "PASSIVE"}


def measure(cfg: Config) -> tuple[list[dict], dict]:
    """The rows, and what they ran on (in the measuring process)."""
    model, rows, steps = sy.load_model(cfg.dtype), [], cfg.warmup_steps + cfg.repeats
    dtype, per_token = dtype_name(model.dtype), model.config.kv_bytes_per_token(model.dtype)
    for n in cfg.sessions:
        for length in cfg.session_tokens:
            systems = {}
            for spec in cfg.policies:
                policy = ResidencyPolicy.parse(spec)
                pool = sy.pool_tokens(policy, n, length, steps)
                row = {"status": "ok", "dtype": dtype, "system": spec, "sessions": n,
                       "session_tokens": length, "kv_pool_mib": pool * per_token / 2**20}
                if pool * per_token > cfg.kv_budget_gib * 2**30:
                    rows.append(row | {"status": "skipped: memory"})
                    continue
                engine = sy.native(model, pool)
                systems[spec] = sy.Decode(engine, sy.open_sessions(engine, n, policy, length),
                                          steps)
                rows.append(row)
            times = interleave(systems, cfg.repeats, warmup=cfg.warmup_steps)
            for row in rows[-len(cfg.policies):]:
                if row["system"] in systems:
                    s, system = stats(times[row["system"]]), systems[row["system"]]
                    row |= {"step_ms_median": s["median_ms"], "step_ms_min": s["min_ms"],
                            "tokens_per_s": n / s["median_ms"] * 1e3,
                            "attended_tokens": statistics.median(system.attended),
                            "resident_tokens": system.engine.resident_tokens(system.sids[0]),
                            "curve": f"{row['system']} N={n}"}
                    print(f"engine: {row['curve']} L={length}: {s['median_ms']:.1f} ms",
                          flush=True)
            del systems
            gc.collect()  # this cell's pools are gone before the next one's
    return rows, {"model": BUNDLED_MODEL, "dtype": dtype,
                  "engine_path": engine_path("fast", model)}


def run(ctx: RunContext, cfg: Config) -> dict:
    env = wait_policy(os.environ)
    rows, facts = in_fresh_process(measure, cfg, env=env)
    ctx.record(**facts, omp_wait_policy=env.get("OMP_WAIT_POLICY", "from the environment: "
                                                + os.environ.get("OMP_WAIT_POLICY", "default")))
    cost, path = fit_step_cost(rows, facts["dtype"]), step_cost_path(ctx.out_json)
    fitted = calibration(ctx.out_json, provenance(**ctx.facts), ctx.command,
                         datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
    cost.save(path, fitted)
    ok = {(r["system"], r["sessions"], r["session_tokens"]): r["step_ms_median"]
          for r in rows if r["status"] == "ok"}
    bounded = next((p for p in cfg.policies if p != "unbounded"), None)
    both = [(length, n) for (p, n, length) in ok if p == bounded and ("unbounded", n, length) in ok]
    length, n = max(both, default=(None, None))
    return REPORT.finish(ctx, {
        "config": asdict(cfg), "rows": rows, "step_cost": asdict(cost) | {
            "path": str(path), "calibration": fitted.describe()},
        "derived": derived(f"unbounded / {bounded} median step at N={n}, L={length}",
                           ok[("unbounded", n, length)] / ok[(bounded, n, length)]
                           if both else None)})


REPORT = Report("Engine: one decode step per residency policy", spec=".2f", tables=(
    Table("Decode step (interleaved per N and L)", "rows"),
    Table("Step cost model fitted from the rows", "step_cost")),
    plots=(Plot("{stem}.png", "rows", x="session_tokens", ys=("step_ms_median",),
                series="curve"),))
report = REPORT.markdown
