"""`metronome bench plan`: the capacity planner's predictions against virtual-clock runs.

Every run is real engine steps on the tiny random Llama with step time from the packaged
cost model (as `metronome experiment admission`), so each measurement repeats exactly:

1. deadline ceiling: the predicted N* (independent phases) and the aligned-phase N* against
   `harness.scenario.sweep_n_star` (largest fixed N with steady p95 latency <= 0.8 x deadline)
   for several session profiles; optionally also against the N* an admission experiment's
   summary.json reports (`bounded.n_star`);
2. memory ceiling, bounded: the predicted sessions-that-fit against the largest N whose run
   in a small pool never stalls on KV (arrivals spread over one period);
3. t_sat, unbounded: the predicted block- and token-level saturation time against the first
   `stalled_kv` frame, counted from the sessions' mean first frame (as `experiment predict`).
Writes JSON and a markdown report (`docs/results/plan.md` by default).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import fmean

import torch

from metronome.bench.engine.machine import machine
from metronome.kv.residency import ResidencyPolicy
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import random_model
from metronome.plan.budget import kv_budget
from metronome.plan.planner import PlanInputs, make_plan
from metronome.runtime.frame import FrameStatus
from metronome.runtime.ports import Listeners
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.sim.recorder import RunRecorder
from metronome.sim.scenario import Scenario, sweep_n_star
from metronome.sim.search import largest_passing
from metronome.sim.workload import Workload, schedule

# Cheap enough that frames never queue: memory runs measure blocks, not the deadline.
FAST_COST = StepCostModel(fixed_s=0.02, per_token_s=1e-5, per_context_token_s=1e-8)


@dataclass(frozen=True)
class Profile:
    name: str
    policy: str
    frame_period_s: float = 1.0
    input_tokens: int = 12
    output_tokens: int = 4
    session_s: float = 40.0  # harness.scenario.run_fixed's default duration


DEADLINE_PROFILES = (
    Profile("admission experiment (4+128, 12 in / 4 out, 1 s)", "sinks_window:4:128"),
    Profile("short frames (4+64, 6 in / 2 out, 0.5 s)", "sinks_window:4:64", 0.5, 6, 2),
    Profile("long window (4+512, 12 in / 4 out, 1 s)", "sinks_window:4:512"),
    Profile("long prompt (window 64, 100 in / 2 out, 2 s)", "window:64", 2.0, 100, 2),
    Profile("unbounded, 40 s sessions (12 in / 4 out, 1 s)", "unbounded"),
)
SMOKE_PROFILES = DEADLINE_PROFILES[:2]


def predicted(profile: Profile, cost: StepCostModel, pool_tokens: int,
              **extra) -> dict:
    budget = kv_budget(TINY_LLAMA, torch.float32, 16, pool_tokens=pool_tokens)
    return make_plan(PlanInputs(
        model_name="tiny", budget=budget, policy=ResidencyPolicy.parse(profile.policy),
        cost=cost, cost_source="bench", frame_period_s=profile.frame_period_s,
        input_tokens=profile.input_tokens, output_tokens=profile.output_tokens,
        session_s=profile.session_s, **extra)).to_dict()


def scenario(model, profile: Profile, cost: StepCostModel, pool_tokens: int) -> Scenario:
    return Scenario(model, cost, policy=profile.policy, pool_tokens=pool_tokens,
                    frame_period_s=profile.frame_period_s,
                    tokens_per_frame=profile.input_tokens, output_tokens=profile.output_tokens)


def deadline_rows(model, cost: StepCostModel, profiles, n_max: int) -> list[dict]:
    rows = []
    for profile in profiles:
        started = time.perf_counter()
        plan = predicted(profile, cost, 1 << 20)
        swept, _ = sweep_n_star(scenario(model, profile, cost, 1 << 20), n_max=n_max,
                                duration_s=profile.session_s)
        rows.append({"profile": profile.name, "policy": profile.policy,
                     "predicted": plan["deadline_ceiling"],
                     "predicted_aligned": plan["deadline_ceiling_aligned"], "swept": swept,
                     "error": _error(plan["deadline_ceiling"], swept),
                     "error_aligned": _error(plan["deadline_ceiling_aligned"], swept),
                     "elapsed_s": time.perf_counter() - started})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def stalls(model, profile: Profile, pool_tokens: int, sessions: int, spread_s: float,
           duration_s: float) -> tuple[list, RunRecorder]:
    recorder = RunRecorder()
    sc = scenario(model, profile, FAST_COST, pool_tokens)
    _, driver = sc.driver(Listeners.of(recorder))
    workload = Workload(sessions, duration_s, arrival_spread_s=spread_s)
    schedule(workload, sc.profile(), driver.beat, driver.clock, sc.source())
    driver.run_until(workload.end_s + 2)
    return [r for r in recorder.results if r.status is FrameStatus.STALLED_KV], recorder


def memory_rows(model, pool_blocks: int, n_max: int) -> list[dict]:
    rows = []
    for profile in (Profile("4+128, 16 tokens/frame", "sinks_window:4:128", session_s=30.0),
                    Profile("4+128, 15 tokens/frame", "sinks_window:4:128", output_tokens=3,
                            session_s=30.0),
                    Profile("4+64, 8 tokens/frame", "sinks_window:4:64", 0.5, 6, 2, 30.0)):
        plan = predicted(profile, FAST_COST, pool_blocks * 16)

        def ok(n: int, profile=profile) -> bool:
            found, _ = stalls(model, profile, pool_blocks * 16, n, profile.frame_period_s,
                              profile.session_s)
            return not found

        measured = largest_passing(ok, n_max)
        rows.append({"profile": profile.name, "pool_blocks": pool_blocks,
                     "blocks_per_session": plan["blocks_per_session"],
                     "predicted": plan["memory_ceiling"], "measured": measured,
                     "error": _error(plan["memory_ceiling"], measured)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def t_sat_rows(model, pool_blocks: int) -> list[dict]:
    rows = []
    profile = Profile("unbounded, 12 in / 4 out, 1 s", "unbounded", session_s=400.0)
    for sessions, spread_s in ((7, 0.0), (8, 0.0), (6, 10.0), (12, 10.0)):
        plan = predicted(profile, FAST_COST, pool_blocks * 16, sessions=sessions)
        found, recorder = stalls(model, profile, pool_blocks * 16, sessions, spread_s,
                                 profile.session_s)
        first_frames = {}
        for r in recorder.results:
            first_frames.setdefault(r.session_id, r.arrival_s)
        t0 = fmean(first_frames.values())
        observed = min(r.arrival_s for r in found) - t0 if found else None
        block, token = (plan["t_sat_unbounded_block_level_s"],
                        plan["t_sat_unbounded_token_level_s"])
        rows.append({"sessions": sessions, "arrival_spread_s": spread_s,
                     "pool_blocks": pool_blocks, "observed_s": observed,
                     "block_level_s": block, "token_level_s": token,
                     "block_error": _error(block, observed), "token_error": _error(token,
                                                                                   observed)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run_check(cost: StepCostModel, out_dir: str) -> dict:
    """`metronome run --clock virtual --policy unbounded` on SmolLM2 (packaged step cost):
    8 sessions from t = 0 into a 4096-token pool; the first stall against the planner."""
    from metronome.sim.local import RunConfig, run_local

    config = RunConfig(sessions=8, duration_s=80.0, ramp_s=0.0, policy="unbounded",
                       pool_tokens=4096, clock="virtual", cost_model=vars(cost), out=out_dir)
    recorder = RunRecorder()
    run_local(config, recorder=recorder)
    stalled = [r.arrival_s for r in recorder.results if r.status is FrameStatus.STALLED_KV]
    t0 = min(r.arrival_s for r in recorder.results)
    profile = Profile("run check", "unbounded", session_s=config.duration_s)
    block = predicted(profile, cost, config.pool_tokens, sessions=config.sessions)[
        "t_sat_unbounded_block_level_s"]
    observed = min(stalled) - t0 if stalled else None
    return {"command": "metronome run --clock virtual --policy unbounded --pool-tokens 4096 "
                       "--sessions 8 --ramp-s 0 --duration-s 80",
            "observed_s": observed, "block_level_s": block, "block_error": _error(block,
                                                                                  observed)}


def _error(predicted_value, measured) -> float | None:
    if not measured or not isinstance(predicted_value, int | float):
        return None
    return (predicted_value - measured) / measured


def run(out_md: str, out_json: str, smoke: bool, admission_summary: str | None) -> dict:
    started = time.perf_counter()
    cost, calibration = StepCostModel.load(PACKAGED_STEP_COST)
    model = random_model(TINY_LLAMA, torch.float32)
    result = {
        "machine": machine("default"), "cost_model": vars(cost),
        "cost_model_source": calibration.describe(), "smoke": smoke,
        "deadline": deadline_rows(model, cost, SMOKE_PROFILES if smoke else DEADLINE_PROFILES,
                                  n_max=64 if smoke else 128),
        "memory": memory_rows(model, pool_blocks=200 if smoke else 400, n_max=128),
        "t_sat": t_sat_rows(model, pool_blocks=400 if smoke else 800),
    }
    if not smoke:
        with tempfile.TemporaryDirectory() as scratch:  # its frames.csv is not a result
            result["run_check"] = run_check(cost, scratch)
    if admission_summary is not None:
        result["admission_experiment"] = _admission_row(Path(admission_summary), cost)
    result["elapsed_s"] = time.perf_counter() - started
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=2, default=str))
    Path(out_md).write_text(render(result, out_json))
    return result


def _admission_row(path: Path, cost: StepCostModel) -> dict:
    summary = json.loads(path.read_text())
    bounded = DEADLINE_PROFILES[0]
    plan = predicted(bounded, StepCostModel(**summary["cost_model"]), 1 << 20)
    unbounded = replace(bounded, policy="unbounded", session_s=60.0)
    pool = summary["unbounded"]["pool_tokens"]
    memory = predicted(unbounded, cost, pool)["memory_ceiling"]
    swept, mem_swept = summary["bounded"]["n_star"], summary["unbounded"]["memory_n_star"]
    return {"summary": str(path), "command": summary["command"], "swept_n_star": swept,
            "predicted_n_star": plan["deadline_ceiling"],
            "error": _error(plan["deadline_ceiling"], swept),
            "unbounded_pool_tokens": pool, "memory_n_star": mem_swept,
            "predicted_memory_ceiling_60s": memory}


def render(r: dict, out_json: str) -> str:
    from metronome.bench.plan_report import render as render_md

    return render_md(r, out_json)
