"""`metronome bench engine`: one batched decode step of N sessions L tokens long, each
residency policy (unbounded, sinks+window) and transformers as a user writes it, side by
side; and the virtual clock's step cost fitted from our rows (written beside the JSON as
`<name>_step_cost.json`; the packaged `sim/step_cost.json` is a copy of one).

Per (N, L) every system is alive at once and their steps interleaved (`bench.steps`); a
system whose KV alone would exceed `kv_budget_gib` is skipped. It measures in a fresh process
with OpenMP's passive wait unless the environment sets a policy (`wait_policy`). Derived
number: unbounded over bounded median step at the largest N and L both ran.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from metronome.bench.presets import knob
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "engine"
GIB = 1 << 30


@dataclass(frozen=True)
class Config:
    sessions: tuple[int, ...] = knob((1, 8, 32, 64), "sessions decoding in one step (N)")
    session_tokens: tuple[int, ...] = knob((1024, 4096, 8192), "tokens of history (L)")
    policies: tuple[str, ...] = knob(("unbounded", "sinks_window:4:512"), "our systems")
    transformers: bool = knob(True, "also transformers (--no-transformers: only what the "
                              "step cost is fitted from, about a minute)")
    repeats: int = knob(5, "timed steps per system, interleaved")
    warmup_steps: int = knob(2, "untimed steps per system first")
    dtype: str = knob("auto", "the bundled model's dtype")
    kv_budget_gib: float = knob(6.0, "a system whose KV exceeds this is skipped")

    @classmethod
    def smoke(cls) -> Config:
        return cls(sessions=(1, 4), session_tokens=(64, 256),
                   policies=("unbounded", "sinks_window:4:32"), repeats=2, warmup_steps=1,
                   kv_budget_gib=1.0)


def wait_policy(environ) -> dict[str, str]:
    """What the measuring process adds to its environment: OpenMP's passive wait, unless the
    environment chose a policy (spinning turns a step into seconds while another process
    holds a core, and OpenMP reads its policy once, when torch loads)."""
    chosen = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(environ)
    return {} if chosen else {"OMP_WAIT_POLICY": "PASSIVE"}


def run(ctx: RunContext, cfg: Config) -> dict:
    import os

    from metronome.bench.engine.step_cost import calibration, fit_step_cost, step_cost_path
    from metronome.bench.workload import in_fresh_process
    from metronome.results.provenance import provenance

    env = wait_policy(os.environ)
    rows, facts = in_fresh_process(measure, cfg, env=env)
    ctx.record(**facts, omp_wait_policy=env.get("OMP_WAIT_POLICY", "from the environment: "
                                                + os.environ.get("OMP_WAIT_POLICY", "default")))
    cost, path = fit_step_cost(rows, facts["dtype"]), step_cost_path(ctx.out_json)
    fitted = calibration(ctx.out_json, provenance(**ctx.facts), ctx.command,
                         datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
    cost.save(path, fitted)
    result = {"config": asdict(cfg), "rows": rows, "derived": _derived(rows, cfg),
              "step_cost": [asdict(cost) | {"path": str(path),
                                            "calibration": fitted.describe()}]}
    return REPORT.finish(ctx, result)


def measure(cfg: Config) -> tuple[list[dict], dict]:
    """The rows, and what they ran on (in the measuring process)."""
    from metronome.bench import systems as sy
    from metronome.bench.engine.facts import BUNDLED_MODEL, dtype_name, engine_path
    from metronome.bench.steps import interleave, stats
    from metronome.kv.residency import ResidencyPolicy

    model = sy.load_model(cfg.dtype)
    dtype, per_token = dtype_name(model.dtype), model.config.kv_bytes_per_token(model.dtype)
    hf = sy.load_transformers(model.dtype) if cfg.transformers else None
    steps, rows = cfg.warmup_steps + cfg.repeats, []
    for n in cfg.sessions:
        for length in cfg.session_tokens:
            systems, skipped = {}, []
            for spec in cfg.policies:
                policy = ResidencyPolicy.parse(spec)
                pool = sy.pool_tokens(policy, n, length, steps)
                if pool * per_token > cfg.kv_budget_gib * GIB:
                    skipped.append(spec)
                    continue
                engine = sy.native(model, pool)
                sids = sy.open_sessions(engine, n, policy, length)
                systems[spec] = sy.Decode(engine, sids, steps)
            if hf is not None and n * (length + steps) * per_token > cfg.kv_budget_gib * GIB:
                skipped.append("transformers")
            elif hf is not None:
                systems["transformers"] = sy.Transformers(hf, n, length)
            times = interleave(systems, cfg.repeats, warmup=cfg.warmup_steps)
            for name, system in systems.items():
                s = stats(times[name])
                resident = (system.cache.get_seq_length() if name == "transformers" else
                            system.engine.resident_tokens_by_session()[system.sids[0]])
                rows.append({"status": "ok", "dtype": dtype, "system": name, "sessions": n,
                             "session_tokens": length, "step_ms_median": s["median_ms"],
                             "step_ms_min": s["min_ms"], "tokens_per_s": n / s["median_ms"] * 1e3,
                             "attended_tokens": statistics.median(system.attended),
                             "resident_tokens": resident, "curve": f"{name} N={n}"})
                print(f"engine: {name} N={n} L={length}: {s['median_ms']:.1f} ms", flush=True)
            rows += [{"status": "skipped: memory", "dtype": dtype, "system": name,
                      "sessions": n, "session_tokens": length} for name in skipped]
            del systems
            gc.collect()  # this cell's pools are gone before the next one's
    return rows, {"model": BUNDLED_MODEL, "dtype": dtype, "engine_path": engine_path("fast",
                                                                                      model)}


def _derived(rows: list[dict], cfg: Config) -> dict:
    ok = {(r["system"], r["sessions"], r["session_tokens"]): r for r in rows
          if r["status"] == "ok"}
    bounded = next((p for p in cfg.policies if p != "unbounded"), None)
    both = [(n, length) for n in cfg.sessions for length in cfg.session_tokens
            if ("unbounded", n, length) in ok and (bounded, n, length) in ok]
    if not both:
        return derived("unbounded / bounded median step", None)
    n, length = max(both, key=lambda c: (c[1], c[0]))
    return derived(f"unbounded / {bounded} median step at N={n}, L={length}",
                   ok[("unbounded", n, length)]["step_ms_median"]
                   / ok[(bounded, n, length)]["step_ms_median"])


REPORT = Report("Engine step: bounded vs unbounded vs transformers", spec=".2f", tables=(
    Table("Decode step (medians over interleaved steps)", "rows", (
        ("system", "system", ""), ("N", "sessions", ""), ("L", "session_tokens", ""),
        ("median ms", "step_ms_median", ".1f"), ("min ms", "step_ms_min", ".1f"),
        ("tokens/s", "tokens_per_s", ".0f"), ("keys attended", "attended_tokens", ".0f"),
        ("resident tokens", "resident_tokens", ""), ("status", "status", ""))),
    Table("Step cost model (fitted from our rows)", "step_cost", (
        ("fixed_s", "fixed_s", ".4g"), ("per_token_s", "per_token_s", ".4g"),
        ("per_context_token_s", "per_context_token_s", ".4g"), ("written to", "path", ""),
        ("calibration", "calibration", "")))),
    plots=(Plot("{stem}.png", "rows", x="session_tokens", ys=("step_ms_median",),
                series="curve"),))
report = REPORT.markdown
