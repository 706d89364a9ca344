"""`metronome bench plan`: the capacity planner's predictions against virtual-clock runs.

Every run is real engine steps on the tiny random Llama (`bench.workload`, virtual clock),
so each measurement repeats exactly. (1) Deadline ceiling: the predicted N* (independent
phases, and aligned phases) against `sim.scenario.sweep_n_star` (largest fixed N with steady
p95 latency <= target x deadline; the packaged step cost) for several session profiles.
(2) Memory ceiling, bounded: predicted sessions-that-fit against the largest N whose run in a
small pool never stalls on KV (a step cost cheap enough that no frame queues). (3) t_sat,
unbounded: the predicted saturation time (block and token level) against the first
`stalled_kv` frame, from the sessions' mean first frame. Error = (predicted - measured) /
measured. Derived number: the largest |error| of the predicted N* over the profiles.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from metronome.bench.presets import knob
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived
from metronome.sim.cost_model import StepCostModel

NAME = "plan"
FAST_COST = StepCostModel(fixed_s=0.02, per_token_s=1e-5, per_context_token_s=1e-8)
# (name, policy, frame period s, input tokens, output tokens, session s)
DEADLINE = (("admission experiment (4+128, 12 in / 4 out, 1 s)", "sinks_window:4:128", 1.0,
             12, 4, 40.0),
            ("short frames (4+64, 6 in / 2 out, 0.5 s)", "sinks_window:4:64", 0.5, 6, 2, 40.0),
            ("long window (4+512, 12 in / 4 out, 1 s)", "sinks_window:4:512", 1.0, 12, 4, 40.0),
            ("long prompt (window 64, 100 in / 2 out, 2 s)", "window:64", 2.0, 100, 2, 40.0),
            ("unbounded, 40 s sessions (12 in / 4 out, 1 s)", "unbounded", 1.0, 12, 4, 40.0))
MEMORY = (("4+128, 16 tokens/frame", "sinks_window:4:128", 1.0, 12, 4, 30.0),
          ("4+128, 15 tokens/frame", "sinks_window:4:128", 1.0, 12, 3, 30.0),
          ("4+64, 8 tokens/frame", "sinks_window:4:64", 0.5, 6, 2, 30.0))
T_SAT = ("unbounded, 12 in / 4 out, 1 s", "unbounded", 1.0, 12, 4, 400.0)
T_SAT_RUNS = ((7, 0.0), (8, 0.0), (6, 10.0), (12, 10.0))  # (sessions, arrivals over s)


@dataclass(frozen=True)
class Config:
    deadline_profiles: int = knob(5, "how many deadline-ceiling profiles to run (in order)")
    sweep_max_sessions: int = knob(128, "largest N the deadline sweeps may try")
    memory_pool_blocks: int = knob(400, "the memory-ceiling runs' pool, in blocks")
    t_sat_pool_blocks: int = knob(800, "the t_sat runs' pool, in blocks")

    @classmethod
    def smoke(cls) -> Config:
        return cls(deadline_profiles=2, sweep_max_sessions=64, memory_pool_blocks=200,
                   t_sat_pool_blocks=400)


def _scenario(model, profile: tuple, cost, pool_tokens: int):
    from metronome.sim.scenario import Scenario

    _, policy, period_s, tokens_in, tokens_out, _ = profile
    return Scenario(model, cost, policy=policy, pool_tokens=pool_tokens, frame_period_s=period_s,
                    tokens_per_frame=tokens_in, output_tokens=tokens_out)


def predicted(profile: tuple, cost, pool_tokens: int, **extra) -> dict:
    import torch

    from metronome.kv.residency import ResidencyPolicy
    from metronome.model.config import TINY_LLAMA
    from metronome.plan.budget import kv_budget
    from metronome.plan.planner import PlanInputs, make_plan

    _, policy, period_s, tokens_in, tokens_out, session_s = profile
    budget = kv_budget(TINY_LLAMA, torch.float32, 16, pool_tokens=pool_tokens)
    return make_plan(PlanInputs(
        model_name="tiny", budget=budget, policy=ResidencyPolicy.parse(policy), cost=cost,
        cost_source="bench", frame_period_s=period_s, input_tokens=tokens_in,
        output_tokens=tokens_out, session_s=session_s, **extra)).to_dict()


def stalls(model, profile: tuple, pool_tokens: int, sessions: int, spread_s: float
           ) -> tuple[list, list]:
    """The frames of a run in a `pool_tokens` pool that stalled on KV, and all its frames."""
    from metronome.bench.workload import run_workload
    from metronome.engine.engine import Engine, EngineConfig
    from metronome.sim.workload import Workload
    from metronome.stream import FrameStatus

    sc = _scenario(model, profile, FAST_COST, pool_tokens)
    workload = Workload(sessions, profile[-1], arrival_spread_s=spread_s)
    run = run_workload(Engine(model, EngineConfig(pool_tokens=pool_tokens)), workload,
                       sc.profile(), sc.source(), clock="virtual", cost=FAST_COST,
                       until_s=workload.end_s + 2)
    return [f for f in run.frames if f.status is FrameStatus.STALLED_KV], run.frames


def _error(predicted_value, measured) -> float | None:
    if not measured or not isinstance(predicted_value, int | float):
        return None
    return (predicted_value - measured) / measured


def run(ctx: RunContext, cfg: Config) -> dict:
    import torch

    from metronome.model.config import TINY_LLAMA
    from metronome.model.weights import random_model
    from metronome.sim.cost_model import PACKAGED_STEP_COST
    from metronome.sim.scenario import sweep_n_star
    from metronome.sim.search import largest_passing

    cost, calibration = StepCostModel.load(PACKAGED_STEP_COST)
    model = random_model(TINY_LLAMA, torch.float32)
    ctx.record(model="tiny random Llama (virtual clock)", dtype="float32",
               cost_model=calibration.describe())
    deadline, memory, t_sat = [], [], []
    for profile in DEADLINE[:cfg.deadline_profiles]:
        plan = predicted(profile, cost, 1 << 20)
        swept, _ = sweep_n_star(_scenario(model, profile, cost, 1 << 20),
                                n_max=cfg.sweep_max_sessions, duration_s=profile[-1])
        deadline.append({"profile": profile[0], "policy": profile[1], "swept": swept,
                         "predicted": plan["deadline_ceiling"],
                         "error": _error(plan["deadline_ceiling"], swept),
                         "predicted_aligned": plan["deadline_ceiling_aligned"],
                         "error_aligned": _error(plan["deadline_ceiling_aligned"], swept)})
        ctx.log(f"plan: {deadline[-1]}")
    pool = cfg.memory_pool_blocks * 16
    for profile in MEMORY:
        plan = predicted(profile, FAST_COST, pool)
        measured = largest_passing(lambda n, p=profile: not stalls(model, p, pool, n, p[2])[0],
                                   128)
        memory.append({"profile": profile[0], "pool_blocks": cfg.memory_pool_blocks,
                       "blocks_per_session": plan["blocks_per_session"],
                       "predicted": plan["memory_ceiling"], "measured": measured,
                       "error": _error(plan["memory_ceiling"], measured)})
    pool = cfg.t_sat_pool_blocks * 16
    for sessions, spread_s in T_SAT_RUNS:
        plan = predicted(T_SAT, FAST_COST, pool, sessions=sessions)
        stalled, frames = stalls(model, T_SAT, pool, sessions, spread_s)
        first = {}
        for f in frames:
            first[f.session_id] = min(first.get(f.session_id, f.arrival_s), f.arrival_s)
        observed = (min(f.arrival_s for f in stalled) - sum(first.values()) / len(first)
                    if stalled else None)
        block, token = (plan["t_sat_unbounded_block_level_s"],
                        plan["t_sat_unbounded_token_level_s"])
        t_sat.append({"sessions": sessions, "arrival_spread_s": spread_s,
                      "pool_blocks": cfg.t_sat_pool_blocks, "observed_s": observed,
                      "block_level_s": block, "block_error": _error(block, observed),
                      "token_level_s": token, "token_error": _error(token, observed)})
    errors = [abs(d["error"]) for d in deadline if d["error"] is not None]
    return REPORT.finish(ctx, {
        "config": asdict(cfg), "cost_model": [asdict(cost)], "fast_cost_model": [
            asdict(FAST_COST)], "deadline": deadline, "memory": memory, "t_sat": t_sat,
        "derived": derived(f"largest |error| of the predicted N* over {len(deadline)} "
                           "profiles", max(errors, default=None))})


REPORT = Report("The capacity planner (`metronome plan`) against measurement", spec=".1%",
                tables=(
    Table("Deadline ceiling N* (packaged step cost)", "deadline", (
        ("profile", "profile", ""), ("predicted", "predicted", ""), ("swept", "swept", ""),
        ("error", "error", "+.1%"), ("aligned phases", "predicted_aligned", ""),
        ("error", "error_aligned", "+.1%"))),
    Table("Memory ceiling, bounded (step cost below)", "memory", (
        ("profile", "profile", ""), ("pool blocks", "pool_blocks", ""),
        ("blocks per session", "blocks_per_session", ""), ("predicted", "predicted", ""),
        ("measured", "measured", ""), ("error", "error", "+.1%"))),
    Table("t_sat, unbounded (step cost below)", "t_sat", (
        ("N", "sessions", ""), ("arrivals over s", "arrival_spread_s", "g"),
        ("pool blocks", "pool_blocks", ""), ("observed s", "observed_s", ".1f"),
        ("block level s", "block_level_s", ".1f"), ("error", "block_error", "+.1%"),
        ("token level s", "token_level_s", ".1f"), ("error", "token_error", "+.1%"))),
    Table("Packaged step cost (the deadline runs)", "cost_model"),
    Table("Step cost of the memory and t_sat runs (no frame queues)", "fast_cost_model")))
report = REPORT.markdown
