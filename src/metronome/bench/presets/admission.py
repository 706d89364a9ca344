"""`metronome bench admission`: the AIMD controller against the offline N* sweep.

Virtual clock (`sim.admission.virtual_runs`: real steps of the tiny random Llama, step time
from the packaged cost model): the offline sweep for N* (largest N with steady p95 latency
<= target x deadline), then AIMD with sessions arriving faster than capacity, bounded (the
server's slow start, and the old linear rule) and unbounded in a pool that fills. Wall clock
(`wall`): the bundled SmolLM2 under the server's controller (`make_limit("aimd")`) with
arrivals faster than capacity, through `bench.workload` in a fresh process whose cores are
kept for the engine thread; `compare_reference` runs it again on the reference path.
Derived number: AIMD's mean cap in the bounded run's second half over the swept N*.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from metronome.bench.presets import knob
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "admission"
WALL_SESSION_S, WALL_JITTER = 30.0, 0.3


@dataclass(frozen=True)
class Config:
    duration_s: float = knob(240.0, "virtual clock: length of each AIMD run")
    sweep_max_sessions: int = knob(256, "virtual clock: largest N the N* sweep may try")
    wall: bool = knob(True, "also the wall-clock run on SmolLM2")
    wall_duration_s: float = knob(150.0, "wall clock: length of the AIMD run")
    wall_arrival_every_s: float = knob(0.25, "wall clock: a session arrives this often")
    compare_reference: bool = knob(False, "the wall-clock run again on the reference path")

    @classmethod
    def smoke(cls) -> Config:
        return cls(duration_s=60.0, sweep_max_sessions=64, wall_duration_s=40.0)


def wall_run(cfg: Config, path: str) -> dict:
    """The wall-clock AIMD run on `path` (in the fresh process `run` starts)."""
    from types import SimpleNamespace

    from metronome.admission.controller import AdmissionController
    from metronome.admission.limits import make_limit
    from metronome.bench.systems import load_model
    from metronome.bench.workload import run_workload
    from metronome.engine.engine import Engine, EngineConfig, for_engine_path
    from metronome.kv.residency import ResidencyPolicy
    from metronome.model.weights import load_tokenizer
    from metronome.runtime.cores import reserve_for_engine_thread
    from metronome.runtime.profile import SessionProfile
    from metronome.sim.admission import summarize
    from metronome.sim.local import text_source
    from metronome.sim.workload import Workload
    from metronome.workload_defaults import EXPERIMENT_POLICY_SPEC, INPUT_TOKENS_PER_FRAME

    reserve_for_engine_thread()
    model = load_model()
    engine = Engine(model, for_engine_path(model, EngineConfig(), path))
    engine.warm_up()
    profile = SessionProfile(policy=ResidencyPolicy.parse(EXPERIMENT_POLICY_SPEC))
    workload = Workload(int(cfg.wall_duration_s / cfg.wall_arrival_every_s), WALL_SESSION_S,
                        arrival_spread_s=cfg.wall_duration_s, duration_jitter=WALL_JITTER)
    run = run_workload(  # the controller as the server builds it
        engine, workload, profile,
        text_source(load_tokenizer(), model.config.vocab_size, INPUT_TOKENS_PER_FRAME),
        admission=lambda active: AdmissionController(
            make_limit("aimd"), active, self_paced_tokens=engine.config.max_chunk_tokens,
            frame_period_s=profile.frame_period_s),
        until_s=cfg.wall_duration_s, log=lambda line: print(f"wall ({path}): {line}"))
    c = run.controller
    return summarize(SimpleNamespace(history=c.history, counts=dict(c.counts),
                                     results=run.recorder.results, saturated_at_s=None),
                     None, cfg.wall_duration_s / 2)


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.bench.server import served_facts
    from metronome.bench.workload import in_fresh_process
    from metronome.sim.admission import virtual_runs
    from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel

    cost, calibration = StepCostModel.load(PACKAGED_STEP_COST)
    ctx.record(cost_model=calibration.describe())
    v = virtual_runs(cost, cfg.duration_s, cfg.sweep_max_sessions)
    ctx.keep("virtual", v)
    runs = {"virtual, bounded": v["bounded"], "virtual, bounded, linear AIMD":
            v["bounded_linear"], "virtual, unbounded (pool fills)": v["unbounded"]}
    paths = ("fast", "reference") if cfg.compare_reference else ("fast",)
    for path in paths if cfg.wall else ():
        ctx.record(**served_facts())
        runs[f"wall clock, {path} path"] = in_fresh_process(wall_run, cfg, path)
        ctx.keep("runs", runs)
    bounded = v["bounded"]
    return REPORT.finish(ctx, {
        "config": asdict(cfg), "workload": v["workload"], "sweep": v["sweep"],
        "runs": [{"run": name} | {k: s[k] for k in s if k != "history"}
                 | {"admitted": s["counts"].get("admitted", 0),
                    "refused": s["counts"].get("refused:at_capacity", 0)}
                 for name, s in runs.items()],
        "history": [{"run": name} | h for name, s in runs.items() for h in s["history"]],
        "derived": derived(f"AIMD's mean cap in the second half over the swept N* = "
                           f"{bounded['n_star']} (virtual clock, bounded)",
                           bounded["steady_cap_mean"] / bounded["n_star"]
                           if bounded["n_star"] and bounded["steady_cap_mean"] else None)})


REPORT = Report("Admission: AIMD against the swept N*", spec=".2f", tables=(
    Table("AIMD runs (second half: after the first half of the run)", "runs", (
        ("run", "run", ""), ("swept N*", "n_star", ""), ("cap mean", "steady_cap_mean", ".1f"),
        ("cap min", "steady_cap_min", ""), ("cap max", "steady_cap_max", ""),
        ("to 0.9 N* (s)", "convergence_s", ".0f"),
        ("misses, 2nd half", "miss_rate_after_convergence", ".2%"),
        ("stalled frames", "stalled_frames", ""), ("goodput", "goodput", ".1%"),
        ("admitted", "admitted", ""), ("refused", "refused", ""))),
    Table("Offline sweep (fixed N, no admission)", "sweep", (
        ("N", "sessions", ""), ("p95 latency / deadline", "p95_fraction", ".3f"),
        ("miss rate", "miss_rate", ".3f"))),
    Table("Workload of the virtual runs", "workload")),
    plots=(Plot("{stem}.png", "history", x="at_s", series="run",
                ys=("cap", "active_sessions", "latency_fraction")),))
report = REPORT.markdown
