"""`metronome bench plan`: `metronome plan`'s predictions against virtual-clock runs of the
tiny random Llama (`bench.workload`): the deadline ceiling N* against `sweep_n_star` (the
packaged step cost); the memory ceiling against the largest N that never stalls on KV; t_sat
against the first `stalled_kv` frame (those two with a step cost so cheap no frame queues).
Derived number: the largest |error| of the predicted N*, error = (predicted - swept) / swept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from metronome.bench.presets import Knobs, knob
from metronome.bench.workload import run_workload
from metronome.engine.engine import Engine, EngineConfig
from metronome.kv.residency import ResidencyPolicy
from metronome.model.config import TINY_LLAMA
from metronome.plan.budget import kv_budget
from metronome.plan.planner import PlanInputs, make_plan
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.sim.scenario import Scenario, sweep_n_star
from metronome.sim.search import largest_passing
from metronome.sim.workload import Workload
from metronome.stream import FrameStatus

NAME = "plan"
FAST_COST = StepCostModel(fixed_s=0.02, per_token_s=1e-5, per_context_token_s=1e-8)
# (name, policy, frame period s, input tokens, output tokens, session s)
DEADLINE = (("4+128, 12 in / 4 out, 1 s", "sinks_window:4:128", 1.0, 12, 4, 40.0),
            ("4+64, 6 in / 2 out, 0.5 s", "sinks_window:4:64", 0.5, 6, 2, 40.0),
            ("4+512, 12 in / 4 out, 1 s", "sinks_window:4:512", 1.0, 12, 4, 40.0),
            ("window 64, 100 in / 2 out, 2 s", "window:64", 2.0, 100, 2, 40.0),
            ("unbounded, 12 in / 4 out, 1 s", "unbounded", 1.0, 12, 4, 40.0))
MEMORY = (("4+128, 12 in / 4 out", "sinks_window:4:128", 1.0, 12, 4, 30.0),
          ("4+128, 12 in / 3 out", "sinks_window:4:128", 1.0, 12, 3, 30.0),
          ("4+64, 6 in / 2 out, 0.5 s", "sinks_window:4:64", 0.5, 6, 2, 30.0))
T_SAT = ("unbounded, 12 in / 4 out, 1 s", "unbounded", 1.0, 12, 4, 400.0)


@dataclass(frozen=True)
class Config(Knobs):
    deadline_profiles: int = knob(5, "how many deadline-ceiling profiles to run (in order)")
    sweep_max_sessions: int = knob(128, "largest N the deadline sweeps may try")
    memory_pool_blocks: int = knob(400, "the memory-ceiling runs' pool, in blocks")
    t_sat_pool_blocks: int = knob(800, "the t_sat runs' pool, in blocks")

    SMOKE = dict(deadline_profiles=2, sweep_max_sessions=64, memory_pool_blocks=200,
                 t_sat_pool_blocks=400)


def scenario(model, profile: tuple, cost, pool_tokens: int) -> Scenario:
    _, policy, period_s, tokens_in, tokens_out, _ = profile
    return Scenario(model, cost, policy=policy, pool_tokens=pool_tokens, frame_period_s=period_s,
                    tokens_per_frame=tokens_in, output_tokens=tokens_out)


def predicted(profile: tuple, cost, pool_tokens: int, **extra) -> dict:
    _, policy, period_s, tokens_in, tokens_out, session_s = profile
    return make_plan(PlanInputs(
        model_name="tiny", budget=kv_budget(TINY_LLAMA, torch.float32, 16,
                                            pool_tokens=pool_tokens),
        policy=ResidencyPolicy.parse(policy), cost=cost, cost_source="bench",
        frame_period_s=period_s, input_tokens=tokens_in, output_tokens=tokens_out,
        session_s=session_s, **extra)).to_dict()


def frames(model, profile: tuple, pool_tokens: int, sessions: int, spread_s: float) -> list:
    """Every frame of a run in a `pool_tokens` pool, sessions opening over `spread_s`."""
    sc, workload = (scenario(model, profile, FAST_COST, pool_tokens),
                    Workload(sessions, profile[-1], arrival_spread_s=spread_s))
    return run_workload(Engine(model, EngineConfig(pool_tokens=pool_tokens)), workload,
                        sc.profile(), sc.source(), clock="virtual", cost=FAST_COST,
                        until_s=workload.end_s + 2).frames


def error(predicted_value, measured) -> float | None:
    ok = measured and isinstance(predicted_value, int | float)
    return (predicted_value - measured) / measured if ok else None


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.model.weights import random_model

    cost, calibration = StepCostModel.load(PACKAGED_STEP_COST)
    model = random_model(TINY_LLAMA, torch.float32)
    ctx.record(model="tiny random Llama (virtual clock)", dtype="float32",
               cost_model=calibration.describe())
    deadline, memory, t_sat = [], [], []
    for profile in DEADLINE[:cfg.deadline_profiles]:
        plan = predicted(profile, cost, 1 << 20)
        swept, _ = sweep_n_star(scenario(model, profile, cost, 1 << 20),
                                n_max=cfg.sweep_max_sessions, duration_s=profile[-1])
        deadline.append({"profile": profile[0], "predicted": plan["deadline_ceiling"],
                         "swept": swept, "error": error(plan["deadline_ceiling"], swept),
                         "aligned_phases": plan["deadline_ceiling_aligned"],
                         "aligned_error": error(plan["deadline_ceiling_aligned"], swept)})
        ctx.log(f"plan: {deadline[-1]}")
    pool = cfg.memory_pool_blocks * 16
    for profile in MEMORY:
        plan = predicted(profile, FAST_COST, pool)
        measured = largest_passing(lambda n, p=profile: not any(
            f.status is FrameStatus.STALLED_KV for f in frames(model, p, pool, n, p[2])), 128)
        memory.append({"profile": profile[0], "pool_blocks": cfg.memory_pool_blocks,
                       "blocks_per_session": plan["blocks_per_session"],
                       "predicted": plan["memory_ceiling"], "measured": measured,
                       "error": error(plan["memory_ceiling"], measured)})
    pool = cfg.t_sat_pool_blocks * 16
    for sessions, spread_s in ((7, 0.0), (8, 0.0), (6, 10.0), (12, 10.0)):
        plan, run_frames = (predicted(T_SAT, FAST_COST, pool, sessions=sessions),
                            frames(model, T_SAT, pool, sessions, spread_s))
        first = {f.session_id: f.arrival_s for f in reversed(run_frames)}  # its earliest
        stall = min((f.arrival_s for f in run_frames if f.status is FrameStatus.STALLED_KV),
                    default=None)
        observed = None if stall is None else stall - sum(first.values()) / len(first)
        block, token = (plan[f"t_sat_unbounded_{k}_level_s"] for k in ("block", "token"))
        t_sat.append({"sessions": sessions, "arrivals_over_s": spread_s,
                      "pool_blocks": cfg.t_sat_pool_blocks, "observed_s": observed,
                      "block_level_s": block, "block_error": error(block, observed),
                      "token_level_s": token, "token_error": error(token, observed)})
    errors = [abs(d["error"]) for d in deadline if d["error"] is not None]
    return REPORT.finish(ctx, {
        "config": asdict(cfg), "step_costs": [asdict(cost) | {"runs": "deadline"},
                                              asdict(FAST_COST) | {"runs": "memory, t_sat"}],
        "deadline": deadline, "memory": memory, "t_sat": t_sat,
        "derived": derived(f"largest |error| of the predicted N* over {len(deadline)} "
                           "profiles", max(errors, default=None))})


REPORT = Report("The capacity planner (`metronome plan`) against measurement", spec=".1%",
                tables=(Table("Deadline ceiling N*", "deadline"),
                        Table("Memory ceiling, bounded", "memory"),
                        Table("t_sat, unbounded (s from the sessions' mean first frame)",
                              "t_sat"),
                        Table("Step costs of the runs", "step_costs")))
report = REPORT.markdown
