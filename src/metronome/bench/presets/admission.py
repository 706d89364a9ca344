"""`metronome bench admission`: AIMD against the offline N* sweep. Virtual clock
(`sim.admission.virtual_runs`, the packaged step cost): the N* sweep, then AIMD with arrivals
faster than capacity, bounded (slow start; the old linear rule) and unbounded in a pool that
fills. Wall clock: the bundled model under the server's controller (`bench.workload`, a fresh
process). Derived number: AIMD's mean cap in the bounded run's second half over N*.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace

from metronome.admission.controller import AdmissionController
from metronome.admission.limits import make_limit
from metronome.bench.presets import Knobs, knob
from metronome.bench.server import served_facts
from metronome.bench.systems import load_model
from metronome.bench.workload import in_fresh_process, run_workload
from metronome.engine.engine import Engine, EngineConfig, for_engine_path
from metronome.kv.residency import ResidencyPolicy
from metronome.model.weights import load_tokenizer
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived
from metronome.runtime.cores import reserve_for_engine_thread
from metronome.runtime.profile import SessionProfile
from metronome.sim.admission import summarize, virtual_runs
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.sim.local import text_source
from metronome.sim.workload import Workload
from metronome.workload_defaults import EXPERIMENT_POLICY_SPEC

NAME = "admission"


@dataclass(frozen=True)
class Config(Knobs):
    duration_s: float = knob(240.0, "virtual clock: length of each AIMD run")
    sweep_max_sessions: int = knob(256, "virtual clock: largest N the N* sweep may try")
    wall: bool = knob(True, "also the wall-clock run on SmolLM2")
    wall_duration_s: float = knob(150.0, "wall clock: length of the AIMD run")
    wall_arrival_every_s: float = knob(0.25, "wall clock: a session arrives this often")
    compare_reference: bool = knob(False, "the wall-clock run again on the reference path")

    SMOKE = dict(duration_s=60.0, sweep_max_sessions=64, wall_duration_s=40.0)


def wall_run(cfg: Config, path: str) -> dict:
    """The wall-clock AIMD run on `path` (in the fresh process `run` starts)."""
    reserve_for_engine_thread()
    model = load_model()
    engine = Engine(model, for_engine_path(model, EngineConfig(), path))
    engine.warm_up()
    profile = SessionProfile(policy=ResidencyPolicy.parse(EXPERIMENT_POLICY_SPEC))
    run = run_workload(  # the controller as the server builds it
        engine, Workload(int(cfg.wall_duration_s / cfg.wall_arrival_every_s), 30.0,
                         arrival_spread_s=cfg.wall_duration_s, duration_jitter=0.3), profile,
        text_source(load_tokenizer(), model.config.vocab_size, 12),  # tokens a frame
        admission=lambda active: AdmissionController(
            make_limit("aimd"), active, self_paced_tokens=engine.config.max_chunk_tokens,
            frame_period_s=profile.frame_period_s),
        until_s=cfg.wall_duration_s, log=lambda line: print(f"wall ({path}): {line}"))
    c = run.controller
    return summarize(SimpleNamespace(history=c.history, counts=dict(c.counts),
                                     results=run.recorder.results, saturated_at_s=None),
                     None, cfg.wall_duration_s / 2)


def run(ctx: RunContext, cfg: Config) -> dict:
    cost, calibration = StepCostModel.load(PACKAGED_STEP_COST)
    ctx.record(cost_model=calibration.describe())
    v = virtual_runs(cost, cfg.duration_s, cfg.sweep_max_sessions)
    runs = {"virtual, bounded": v["bounded"], "virtual, bounded, linear AIMD":
            v["bounded_linear"], "virtual, unbounded (pool fills)": v["unbounded"]}
    for path in (("fast", "reference") if cfg.compare_reference else ("fast",)) * cfg.wall:
        ctx.record(**served_facts())
        runs[f"wall clock, {path} path"] = in_fresh_process(wall_run, cfg, path)
        ctx.keep("runs", runs)
    n_star, cap = v["bounded"]["n_star"], v["bounded"]["steady_cap_mean"]
    return REPORT.finish(ctx, {
        "config": asdict(cfg), "workload": v["workload"], "sweep": v["sweep"],
        "runs": [{"run": name} | {k: x for k, x in s.items() if k not in ("history", "counts")}
                 | s["counts"] for name, s in runs.items()],
        "history": [{"run": name} | h for name, s in runs.items() for h in s["history"]],
        "derived": derived(f"AIMD's mean cap in the second half over the swept N* = {n_star} "
                           "(virtual clock, bounded)", cap / n_star if n_star and cap else None)})


REPORT = Report("Admission: AIMD against the swept N*", spec=".2f", tables=(
    Table("AIMD runs (steady: the second half of the run)", "runs"),
    Table("Offline sweep (fixed N, no admission)", "sweep"),
    Table("Workload of the virtual runs", "workload")),
    plots=(Plot("{stem}.png", "history", x="at_s", series="run",
                ys=("cap", "active_sessions", "latency_fraction")),))
report = REPORT.markdown
