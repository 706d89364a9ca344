"""`metronome bench plan`: the capacity planner's predictions against virtual-clock runs.

Every run is real engine steps on the tiny random Llama with step time from the packaged
cost model (as `metronome experiment admission`), so each measurement repeats exactly:

1. deadline ceiling: the predicted N* (independent phases) and the aligned-phase N* against
   `sim.scenario.sweep_n_star` (largest fixed N with steady p95 latency <= target x deadline)
   for several session profiles; optionally also against the N* an admission experiment's
   summary.json reports (`bounded.n_star`);
2. memory ceiling, bounded: the predicted sessions-that-fit against the largest N whose run
   in a small pool never stalls on KV (arrivals spread over one period);
3. t_sat, unbounded: the predicted block- and token-level saturation time against the first
   `stalled_kv` frame, counted from the sessions' mean first frame (as `experiment predict`).

The report also gives the planner's memory ceiling for the paper's backbones (arithmetic on
their shapes and a GPU's memory; no step cost is assumed, so no N* is claimed for them).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean

import torch

from metronome.kv.residency import ResidencyPolicy
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import random_model
from metronome.plan import PlanRequest
from metronome.plan.budget import kv_budget
from metronome.plan.planner import PlanInputs, make_plan
from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.results.tables import fmt, md_table
from metronome.runtime.frame import FrameStatus
from metronome.runtime.ports import Listeners
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.sim.recorder import RunRecorder
from metronome.sim.scenario import Scenario, sweep_n_star
from metronome.sim.search import largest_passing
from metronome.sim.workload import Workload, schedule
from metronome.workload_defaults import (
    BLOCK_SIZE_TOKENS,
    EXPERIMENT_POLICY_SPEC,
    FRAME_PERIOD_S,
    INPUT_TOKENS_PER_FRAME,
    OUTPUT_TOKENS_PER_FRAME,
)

NAME = "plan"


@dataclass(frozen=True)
class Config:
    deadline_profiles: int = field(default=5, metadata={
        "help": "how many of the deadline-ceiling session profiles to run (in order)"})
    sweep_max_sessions: int = field(default=128, metadata={
        "help": "largest N the deadline sweeps may try"})
    memory_pool_blocks: int = field(default=400, metadata={
        "help": "the memory-ceiling runs' pool, in blocks"})
    t_sat_pool_blocks: int = field(default=800, metadata={
        "help": "the t_sat runs' pool, in blocks"})
    run_check: bool = field(default=True, metadata={
        "help": "also check t_sat through `metronome run --clock virtual` on SmolLM2"})
    admission_summary: str | None = field(default=None, metadata={
        "help": "summary.json of `metronome experiment admission`: also compare its swept N*"})

    def __post_init__(self) -> None:
        if self.admission_summary is not None and not Path(self.admission_summary).is_file():
            raise ValueError(f"--admission-summary: no such file: {self.admission_summary}")

    @classmethod
    def smoke(cls) -> Config:
        return cls(deadline_profiles=2, sweep_max_sessions=64, memory_pool_blocks=200,
                   t_sat_pool_blocks=400, run_check=False)


# Cheap enough that frames never queue: memory runs measure blocks, not the deadline.
FAST_COST = StepCostModel(fixed_s=0.02, per_token_s=1e-5, per_context_token_s=1e-8)


@dataclass(frozen=True)
class Profile:
    name: str
    policy: str
    frame_period_s: float = FRAME_PERIOD_S
    input_tokens: int = INPUT_TOKENS_PER_FRAME
    output_tokens: int = OUTPUT_TOKENS_PER_FRAME
    session_s: float = 40.0  # sim.scenario.run_fixed's default duration


DEADLINE_PROFILES = (
    Profile("admission experiment (4+128, 12 in / 4 out, 1 s)", EXPERIMENT_POLICY_SPEC),
    Profile("short frames (4+64, 6 in / 2 out, 0.5 s)", "sinks_window:4:64", 0.5, 6, 2),
    Profile("long window (4+512, 12 in / 4 out, 1 s)", "sinks_window:4:512"),
    Profile("long prompt (window 64, 100 in / 2 out, 2 s)", "window:64", 2.0, 100, 2),
    Profile("unbounded, 40 s sessions (12 in / 4 out, 1 s)", "unbounded"),
)
SMOKE_PROFILES = DEADLINE_PROFILES[:2]


def predicted(profile: Profile, cost: StepCostModel, pool_tokens: int,
              **extra) -> dict:
    budget = kv_budget(TINY_LLAMA, torch.float32, BLOCK_SIZE_TOKENS, pool_tokens=pool_tokens)
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
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
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
        plan = predicted(profile, FAST_COST, pool_blocks * BLOCK_SIZE_TOKENS)

        def ok(n: int, profile=profile) -> bool:
            found, _ = stalls(model, profile, pool_blocks * BLOCK_SIZE_TOKENS, n,
                              profile.frame_period_s, profile.session_s)
            return not found

        measured = largest_passing(ok, n_max)
        rows.append({"profile": profile.name, "pool_blocks": pool_blocks,
                     "blocks_per_session": plan["blocks_per_session"],
                     "predicted": plan["memory_ceiling"], "measured": measured,
                     "error": _error(plan["memory_ceiling"], measured)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def t_sat_rows(model, pool_blocks: int) -> list[dict]:
    rows = []
    profile = Profile("unbounded, 12 in / 4 out, 1 s", "unbounded", session_s=400.0)
    for sessions, spread_s in ((7, 0.0), (8, 0.0), (6, 10.0), (12, 10.0)):
        plan = predicted(profile, FAST_COST, pool_blocks * BLOCK_SIZE_TOKENS, sessions=sessions)
        found, recorder = stalls(model, profile, pool_blocks * BLOCK_SIZE_TOKENS, sessions,
                                 spread_s, profile.session_s)
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
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
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


def run(ctx: RunContext, cfg: Config) -> dict:
    cost, calibration = StepCostModel.load(PACKAGED_STEP_COST)
    model = random_model(TINY_LLAMA, torch.float32)
    ctx.record(model="tiny random Llama (virtual clock)", dtype="float32")
    result = {"cost_model": vars(cost), "cost_model_source": calibration.describe(),
              "fast_cost_model": vars(FAST_COST)}
    result["deadline"] = deadline_rows(model, cost, DEADLINE_PROFILES[:cfg.deadline_profiles],
                                       n_max=cfg.sweep_max_sessions)
    ctx.keep("deadline", result["deadline"])
    result["memory"] = memory_rows(model, pool_blocks=cfg.memory_pool_blocks, n_max=128)
    ctx.keep("memory", result["memory"])
    result["t_sat"] = t_sat_rows(model, pool_blocks=cfg.t_sat_pool_blocks)
    if cfg.run_check:
        with tempfile.TemporaryDirectory() as scratch:  # its frames.csv is not a result
            result["run_check"] = run_check(cost, scratch)
    if cfg.admission_summary is not None:
        result["admission_experiment"] = _admission_row(Path(cfg.admission_summary), cost)
    result["paper_memory"] = paper_memory()
    return result

def _admission_row(path: Path, cost: StepCostModel) -> dict:
    summary = json.loads(path.read_text())
    bounded = DEADLINE_PROFILES[0]
    plan = predicted(bounded, StepCostModel(**summary["cost_model"]), 1 << 20)
    session_s = summary.get("workload", {}).get("unbounded_session_s", 60.0)
    unbounded = replace(bounded, policy="unbounded", session_s=session_s)
    pool = summary["unbounded"]["pool_tokens"]
    memory = predicted(unbounded, cost, pool)["memory_ceiling"]
    swept, mem_swept = summary["bounded"]["n_star"], summary["unbounded"]["memory_n_star"]
    return {"summary": str(path), "command": summary["command"], "swept_n_star": swept,
            "predicted_n_star": plan["deadline_ceiling"],
            "error": _error(plan["deadline_ceiling"], swept),
            "unbounded_pool_tokens": pool, "memory_n_star": mem_swept,
            "unbounded_session_s": session_s, "predicted_memory_ceiling": memory}


# The paper's setting as far as it is known: one Blackwell GPU, ~500 sessions fitting in
# memory, N* ~ 209 meeting the deadline. It does not say which GPU, which of its four
# backbones, the window, or the step costs: the assumptions below are ours, stated in the
# result, and only the memory side (shapes and bytes) is computed from them.
PAPER = {"reported": "~500 sessions fit in memory, N* ~ 209 meet the deadline (one NVIDIA "
                     "Blackwell GPU)",
         "policy": "sinks_window:4:512", "dtype": "bfloat16", "utilization": 0.9,
         "gpus": ("96GB", "180GB"),
         "models": ("moshi-7b", "qwen2.5-omni-7b", "minicpm-o-4.5", "qwen3-omni-30b-a3b")}
# Qwen3-Omni-30B-A3B's preset is a dense stand-in for its mixture of experts: count the
# real ~30.5 B parameters' weights instead of the stand-in's.
WEIGHTS_OVERRIDE = {"qwen3-omni-30b-a3b": "61GB"}


def paper_memory() -> dict:
    """The planner's memory ceiling of each paper backbone on each GPU size (arithmetic)."""
    rows = []
    for name in PAPER["models"]:
        cells = [make_plan(PlanRequest(
            model=f"preset:{name}", dtype=PAPER["dtype"], gpu_memory=gpu,
            utilization=PAPER["utilization"], weights_bytes=WEIGHTS_OVERRIDE.get(name),
            policy=PAPER["policy"]).inputs()) for gpu in PAPER["gpus"]]
        rows.append({"model": name, "kv_bytes_per_token": cells[0].kv_bytes_per_token,
                     "weights_override": WEIGHTS_OVERRIDE.get(name),
                     "memory_ceiling": {gpu: c.memory_ceiling
                                        for gpu, c in zip(PAPER["gpus"], cells, strict=True)},
                     "blocks_per_session": cells[0].blocks_per_session})
    return {"assumed": {k: v for k, v in PAPER.items() if k != "models"}, "rows": rows}


def _pct(value) -> str:
    return fmt(value, "+.1%")


def _cost(c: dict) -> str:
    return (f"`step_s = {c['fixed_s']:.4g} + {c['per_token_s']:.3g} x tokens + "
            f"{c['per_context_token_s']:.3g} x context tokens`")


def report(r: dict) -> str:
    lines = [
        "# Capacity planner (`metronome plan`) against measurement", "",
        describe(r["provenance"]), "",
        f"Command: `{r['command']}`, {r['elapsed_s']:.0f} s. Written by the command; do not "
        "edit by hand. Every measurement is a virtual-clock run: real engine steps on the "
        "tiny random Llama (`model.config.TINY_LLAMA`), so it repeats exactly. Step costs, "
        "and where each comes from: the deadline runs and `metronome run` use the packaged "
        f"cost model ({r['cost_model_source']}): {_cost(r['cost_model'])}; the memory and "
        f"t_sat runs use a cost given here, cheap enough that no frame queues (they measure "
        f"blocks, not the deadline): {_cost(r['fast_cost_model'])}. Error = (predicted - "
        "measured) / measured.", "",
        "## Deadline ceiling N*", "",
        "Predicted: `plan.deadline` (independent phases: N* = floor((P/w)(1 - (s+1) f / "
        "(q D))); aligned: floor((q D - s f) / w)). Measured: `sim.scenario.sweep_n_star` "
        "(largest fixed N, arrivals spread over one period, with steady p95 latency <= "
        "target x deadline).", "",
        md_table(("profile", "predicted N*", "measured N*", "error", "aligned-phase N*",
                  "error"),
                 [(d["profile"], d["predicted"], d["swept"], _pct(d["error"]),
                   d["predicted_aligned"], _pct(d["error_aligned"])) for d in r["deadline"]]),
    ]
    if "admission_experiment" in r:
        a = r["admission_experiment"]
        lines += ["", f"Against `{a['command']}` (its `summary.json`: `bounded.n_star` = "
                  f"{a['swept_n_star']}): predicted {a['predicted_n_star']}, error "
                  f"{_pct(a['error'])}. Its unbounded memory sweep (static caps over its own "
                  f"arrival stream, pool {a['unbounded_pool_tokens']} tokens) found "
                  f"{a['memory_n_star']}; the planner's memory ceiling for "
                  f"{a['unbounded_session_s']:.0f} s unbounded sessions is "
                  f"{a['predicted_memory_ceiling']} (sessions there arrive over the whole "
                  "run, so the late ones never reach that length: the sweep's number is that "
                  "stream's, and the planner's the worst case)."]
    lines += [
        "", "## Memory ceiling (bounded sessions)", "",
        "Predicted: `free blocks // peak blocks per session` (the peak replayed on a real "
        "`BlockTable`: sinks + window + the blocks of the widest chunk, written before the "
        "window slides). Measured: the largest N whose run (arrivals spread over one period) "
        "never stalls on KV. The prediction is the N at which no session can stall whatever "
        "the phases; with spread arrivals not every session is at its peak at once, so a few "
        "more fit.", "",
        md_table(("profile", "pool blocks", "blocks per session", "predicted", "measured",
                  "error"),
                 [(x["profile"], x["pool_blocks"], x["blocks_per_session"], x["predicted"],
                   x["measured"], _pct(x["error"])) for x in r["memory"]]),
        "", "## t_sat (unbounded sessions fill the pool)", "",
        "Predicted: block level floor(F/N) b / r and the paper's token level (1 - rho0) P / "
        "(N r). Measured: the first `stalled_kv` frame, from the sessions' mean first frame.",
        "",
        md_table(("N", "arrivals over", "pool blocks", "measured", "block level", "error",
                  "token level", "error"),
                 [(t["sessions"], f"{t['arrival_spread_s']:g} s", t["pool_blocks"],
                   f"{fmt(t['observed_s'], '.1f')} s", f"{t['block_level_s']:.1f} s",
                   _pct(t["block_error"]), f"{t['token_level_s']:.1f} s",
                   _pct(t["token_error"])) for t in r["t_sat"]]),
    ]
    if "run_check" in r:
        c = r["run_check"]
        lines += ["", f"Same check through `metronome run` on SmolLM2 (`{c['command']}`, "
                  "packaged step cost): first `stalled_kv` frame "
                  f"{fmt(c['observed_s'], '.1f')} s after the first frame, planner "
                  f"{c['block_level_s']:.1f} s (block level, error {_pct(c['block_error'])})."]
    return "\n".join(lines + _paper_section(r["paper_memory"])) + "\n"


def _paper_section(p: dict) -> list[str]:
    a = p["assumed"]
    gpus = a["gpus"]
    overrides = [f"{row['model']} weights {row['weights_override']}" for row in p["rows"]
                 if row["weights_override"]]
    return [
        "", "## The paper's setting: memory side only", "",
        f"The paper reports {a['reported']}. It does not say which GPU, which of its "
        "backbones those numbers are for, the window, or the step costs. Assumed here: "
        f"{a['dtype']}, `{a['policy']}`, {a['utilization']:g} of the GPU's memory for the "
        "engine, weights counted from the shapes"
        + (f" (except {', '.join(overrides)})" if overrides else "") + ". The planner's "
        "memory ceiling of each backbone under those assumptions:", "",
        md_table(("backbone", "KV bytes/token", *(f"{g} GPU" for g in gpus)),
                 [(row["model"], f"{row['kv_bytes_per_token']:,}",
                   *(f"{row['memory_ceiling'][g]:,}" for g in gpus)) for row in p["rows"]]),
        "", "The deadline side (N*) needs a step cost model measured on that GPU, which we "
        "do not have, so this report predicts no N* for the paper's setting.",
    ]
