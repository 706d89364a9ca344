"""`metronome bench runtime`: the beat on the wall clock with the bundled model. For each
policy and N, N sessions open over a ramp and stream Hamlet frames (`bench.workload`, all
runs in one fresh process whose cores are kept for the engine thread); the unbounded runs get
a pool that fills mid-run (the silent cliff beside the bounded runs). Derived number: the
lowest goodput of the bounded runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from metronome.bench.engine.facts import BUNDLED_MODEL
from metronome.bench.presets import Knobs, knob
from metronome.bench.server import served_facts
from metronome.bench.systems import load_model
from metronome.bench.workload import in_fresh_process, run_workload, summary
from metronome.engine.engine import Engine, EngineConfig
from metronome.kv.residency import ResidencyPolicy
from metronome.model.weights import load_tokenizer
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived
from metronome.runtime.cores import reserve_for_engine_thread
from metronome.runtime.profile import SessionProfile
from metronome.sim.local import text_source
from metronome.sim.workload import Workload
from metronome.workload_defaults import EXPERIMENT_POLICY_SPEC, POOL_TOKENS

NAME = "runtime"


@dataclass(frozen=True)
class Config(Knobs):
    sessions: tuple[int, ...] = knob((1, 4, 8, 16, 24), "session counts N, each policy")
    duration_s: float = knob(30.0, "length of each session")
    ramp_s: float = knob(1.0, "sessions open over this ramp")
    bounded_policy: str = knob(EXPERIMENT_POLICY_SPEC, "the bounded runs' policy")
    bounded_pool_tokens: int = knob(POOL_TOKENS, "the bounded runs' KV pool")
    unbounded_pool_tokens: int = knob(4096, "the unbounded runs' KV pool (fills mid-run)")
    dtype: str = knob("auto", "the bundled model's dtype")

    SMOKE = dict(sessions=(1, 2), duration_s=4.0)


def runs(cfg: Config) -> list[dict]:
    """Every (policy, N) run (in the fresh process `run` starts)."""
    reserve_for_engine_thread()  # before the model loads (runtime.cores)
    model, rows = load_model(cfg.dtype), []
    source = text_source(load_tokenizer(), model.config.vocab_size, 12)
    for policy, pool in ((cfg.bounded_policy, cfg.bounded_pool_tokens),
                         ("unbounded", cfg.unbounded_pool_tokens)):
        for n in cfg.sessions:
            engine = Engine(model, EngineConfig(pool_tokens=pool))
            engine.warm_up()
            run = run_workload(engine, Workload(n, cfg.duration_s, cfg.ramp_s),
                               SessionProfile(policy=ResidencyPolicy.parse(policy)), source)
            rows.append({"policy": policy, "pool_tokens": pool, "sessions": n} | summary(run))
            print(f"runtime: {policy}, {n} sessions: goodput {rows[-1]['goodput']}", flush=True)
    return rows


def run(ctx: RunContext, cfg: Config) -> dict:
    ctx.record(**served_facts(BUNDLED_MODEL, cfg.dtype))
    rows = in_fresh_process(runs, cfg)
    goodput = [r["goodput"] for r in rows if r["policy"] != "unbounded" and r["goodput"]]
    return REPORT.finish(ctx, {"config": asdict(cfg), "rows": rows, "derived": derived(
        f"lowest goodput of the bounded runs ({cfg.bounded_policy})", min(goodput, default=None))})


REPORT = Report("The beat on the wall clock", spec=".1%", tables=(
    Table("Runs (frames due: arrived a deadline before the run stopped)", "rows"),),
    plots=(Plot("{stem}.png", "rows", x="sessions", ys=("goodput", "p95_ms"),
                series="policy"),))
report = REPORT.markdown
