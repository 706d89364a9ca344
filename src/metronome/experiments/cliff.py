"""`metronome experiment cliff`: the silent, metastable latency cliff, N runs x 2 policies
(20 at full scale, as in the paper).

One workload, run with 20 seeds: N sessions open at uniformly random times over the first
`arrival_spread_s`, each lasting `session_s x U(1 - jitter, 1 + jitter)`, streaming one
frame a second (12 input tokens, 4 output tokens: 16 KV tokens a second). The pool is sized
so the first-order saturation time (all N sessions growing from the mean arrival) falls
inside the spread of session durations: whether a run saturates is a race between fill
rate and sessions leaving, decided by the jitter alone. Each seed runs unbounded and bounded
(sinks + window), same arrivals, same durations.

Clock: virtual. The engine really runs every step (real block pool, real stalls, real
tokens) on a tiny random Llama; each step's *time* comes from the cost model fitted from
`metronome bench engine` (SmolLM2 bf16 on this CPU). That makes 40 runs take minutes and
repeat exactly; the pool dynamics, which decide the cliff, do not depend on the weights.

"Hit the wall" (the run collapses): some session gets WALL_FRAMES or more consecutive
`stalled_kv` frames, i.e. that many seconds of silence while it keeps talking.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import fmean, median

import torch

from metronome.experiments.common import STEP_COST_HELP, VIRTUAL_CLOCK, cost_model
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import random_model
from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.results.tables import fmt
from metronome.runtime.ports import Listeners
from metronome.sim.cost_model import StepCostModel
from metronome.sim.recorder import RunRecorder
from metronome.sim.scenario import Scenario
from metronome.sim.workload import Workload, schedule
from metronome.stats import percentile
from metronome.stream import Frame, FrameStatus
from metronome.workload_defaults import (
    BLOCK_SIZE_TOKENS,
    EXPERIMENT_POLICY_SPEC,
    INPUT_TOKENS_PER_FRAME,
    OUTPUT_TOKENS_PER_FRAME,
)

NAME = "cliff"
REQUIRED_FIELDS = ("workload", "wall_definition", "runs", "collapsed", "policies")
WALL_FRAMES = 3  # consecutive stalled_kv frames of one session = it hit the wall


@dataclass(frozen=True)
class Config:
    runs: int = field(default=20, metadata={"help": "seeds, each run unbounded and bounded "
                                            "(20 as in the paper)"})
    wall_check: bool = field(default=True, metadata={
        "help": "rerun the first seed that hit the wall on the wall clock with SmolLM2 "
                "(minutes of real time)"})
    step_cost: str | None = field(default=None, metadata={"help": STEP_COST_HELP})

    @classmethod
    def smoke(cls) -> Config:
        return cls(runs=3, wall_check=False)


@dataclass(frozen=True)
class CliffWorkload:
    sessions: int = 16
    arrival_spread_s: float = 20.0
    session_s: float = 40.0
    jitter: float = 0.5
    tokens_per_frame: int = INPUT_TOKENS_PER_FRAME
    output_tokens: int = OUTPUT_TOKENS_PER_FRAME
    block_size: int = BLOCK_SIZE_TOKENS
    bounded_policy: str = EXPERIMENT_POLICY_SPEC
    # First-order t_sat with all sessions growing from the mean arrival:
    # 10 s + 6400 / (16 x 16 tokens/s) = 35 s, inside the durations' spread [20, 60] s.
    pool_tokens: int = 6400

    @property
    def tokens_per_s(self) -> int:  # per session, frame period 1 s
        return self.tokens_per_frame + self.output_tokens

    @property
    def first_order_t_sat_s(self) -> float:
        return self.arrival_spread_s / 2 + self.pool_tokens / (self.sessions * self.tokens_per_s)

    def plan(self, seed: int) -> Workload:
        return Workload(self.sessions, self.session_s, arrival_spread_s=self.arrival_spread_s,
                        duration_jitter=self.jitter, seed=seed)

    def peak_demand_blocks(self, seed: int) -> int:
        """Blocks the unbounded sessions of this seed would hold at their peak with an
        infinite pool (1 s resolution): above the pool means the run must stall."""
        plan = self.plan(seed).plan()
        end_s = max(start + duration for start, duration in plan)
        per_block_s = self.block_size / self.tokens_per_s
        peak = 0
        for tenth in range(int(end_s * 10) + 1):
            t = tenth / 10
            held = sum(math.ceil(max(0.0, t - start - 1) / per_block_s)
                       for start, duration in plan if start <= t < start + duration + 1)
            peak = max(peak, held)
        return peak


def run_once(model, cost: StepCostModel, wl: CliffWorkload, policy: str, seed: int) -> dict:
    """One run; per-frame results and per-step pool occupancy, condensed."""
    scenario = Scenario(model, cost, policy=policy, pool_tokens=wl.pool_tokens,
                        block_size=wl.block_size, tokens_per_frame=wl.tokens_per_frame,
                        output_tokens=wl.output_tokens)
    recorder = RunRecorder()
    _, driver = scenario.driver(Listeners.of(recorder))
    workload = wl.plan(seed)
    schedule(workload, scenario.profile(), driver.beat, driver.clock, scenario.source())
    driver.run_until(workload.end_s + 3)
    return condense(recorder, policy, seed, workload.end_s + 3)


def condense(recorder: RunRecorder, policy: str, seed: int, end_s: float) -> dict:
    """One run's frames and steps (virtual or wall clock) as the cliff's numbers + series."""
    results = recorder.results
    steps = [(s.finished_s, s.used_blocks / (s.used_blocks + s.free_blocks))
             for s in recorder.steps]  # (finished_s, pool used fraction)
    by_session: dict[str, list[Frame]] = defaultdict(list)
    for r in sorted(results, key=lambda r: (r.session_id, r.index)):
        by_session[r.session_id].append(r)
    longest, walled_sessions = 0, 0
    perceived: list[tuple[float, float]] = []  # (arrival_s, user-perceived latency s)
    for frames in by_session.values():
        run = best = 0
        for r in frames:
            run = run + 1 if r.status is FrameStatus.STALLED_KV else 0
            best = max(best, run)
        longest = max(longest, best)
        walled_sessions += best >= WALL_FRAMES
        # what the user waits: a good frame's latency; a bad frame's wait until the
        # session's next good frame (or the end of the run: censored)
        next_good_s = end_s
        for r in reversed(frames):
            if r.good:
                next_good_s = r.finish_s
                perceived.append((r.arrival_s, r.latency_s))
            else:
                perceived.append((r.arrival_s, next_good_s - r.arrival_s))
    stalls = [r.finish_s for r in results if r.status is FrameStatus.STALLED_KV]
    latencies = [r.latency_s for r in results]
    return {
        "policy": policy, "seed": seed, "frames": len(results),
        "hit_wall": longest >= WALL_FRAMES, "longest_stall_run_frames": longest,
        "sessions_hit_wall": walled_sessions, "sessions": len(by_session),
        "first_stall_s": min(stalls) if stalls else None,
        "stalled_frames": len(stalls), "silent_frames": sum(not r.good for r in results),
        "goodput": sum(r.good for r in results) / max(1, len(results)),
        "deadline_met_fraction": sum(r.deadline_met for r in results) / max(1, len(results)),
        "latency_ms_p50": 1e3 * percentile(latencies, 50),
        "latency_ms_p95": 1e3 * percentile(latencies, 95),
        "peak_pool_fraction": max((u for _, u in steps), default=0.0),
        # time series for the plots (1 s bins)
        "series": _series(results, perceived, steps, end_s),
    }


def _series(results, perceived, steps, end_s: float) -> dict:
    bins = int(end_s) + 1
    reported: list[list[float]] = [[] for _ in range(bins)]
    user: list[list[float]] = [[] for _ in range(bins)]
    good = [[0, 0, 0] for _ in range(bins)]  # good, deadline met, frames
    for r in results:
        b = min(bins - 1, int(r.arrival_s))
        reported[b].append(r.latency_s)
        good[b][0] += r.good
        good[b][1] += r.deadline_met
        good[b][2] += 1
    for arrival_s, wait_s in perceived:
        user[min(bins - 1, int(arrival_s))].append(wait_s)
    pool = [0.0] * bins
    for finished_s, used in steps:
        b = min(bins - 1, int(finished_s))
        pool[b] = max(pool[b], used)
    return {
        "t_s": list(range(bins)),
        "reported_latency_ms_p95": [1e3 * percentile(v, 95) if v else None for v in reported],
        "user_latency_ms_p50": [1e3 * percentile(v, 50) if v else None for v in user],
        "goodput": [g / n if n else None for g, _, n in good],
        "deadline_met": [m / n if n else None for _, m, n in good],
        "pool_fraction": pool,
    }


def wall_check(ctx: RunContext, wl: CliffWorkload, policy: str, seed: int) -> dict:
    """The same seed on the wall clock with the real SmolLM2 (bf16, Hamlet text): does the
    virtual picture (same pool, same arrivals) hold when every step takes its real time?"""
    from metronome.sim.local import RunConfig, run_local

    name = "wall_" + policy.split(":")[0]
    config = RunConfig(sessions=wl.sessions, duration_s=wl.session_s,
                       ramp_s=wl.arrival_spread_s, duration_jitter=wl.jitter,
                       tokens_per_frame=wl.tokens_per_frame, output_tokens=wl.output_tokens,
                       policy=policy, pool_tokens=wl.pool_tokens, block_size=wl.block_size,
                       clock="wall", seed=seed, out=str(ctx.out_dir / name))
    recorder = RunRecorder()
    run_local(config, ctx.console, recorder=recorder)
    return condense(recorder, policy, seed, config.workload().end_s + 2)


def run(ctx: RunContext, cfg: Config) -> dict:
    wl = CliffWorkload()
    num_runs = cfg.runs
    cost, cost_source = cost_model(cfg.step_cost)
    model = random_model(TINY_LLAMA, torch.float32, seed=ctx.seed)
    policies = ("unbounded", wl.bounded_policy)
    seeds = [ctx.seed + k for k in range(num_runs)]
    ctx.log(f"cliff: {num_runs} runs x {policies}; pool {wl.pool_tokens} tokens, "
            f"{wl.sessions} sessions; step cost from {cost_source}")
    runs: list[dict] = []
    with ctx.progress("cliff runs", num_runs * len(policies)) as advance:
        for seed in seeds:
            for policy in policies:
                runs.append(run_once(model, cost, wl, policy, seed))
                advance()
    demand = {seed: wl.peak_demand_blocks(seed) for seed in seeds}
    for r in runs:
        r["predicted_to_stall"] = demand[r["seed"]] > wl.pool_tokens // wl.block_size
    collapsed = {p: sum(r["hit_wall"] for r in runs if r["policy"] == p) for p in policies}
    wall_runs: list[dict] = []
    walled = [r["seed"] for r in runs if r["policy"] == "unbounded" and r["hit_wall"]]
    if cfg.wall_check and walled:  # minutes of real time each
        ctx.log(f"cliff: wall-clock check of seed {walled[0]} on SmolLM2 (real time)")
        wall_runs = [wall_check(ctx, wl, policy, walled[0]) for policy in policies]
    ctx.record(model="tiny random Llama (virtual clock)", dtype="float32")
    summary = {
        "experiment": NAME, "clock": VIRTUAL_CLOCK, "num_runs": num_runs,
        "workload": vars(wl) | {"first_order_t_sat_s": wl.first_order_t_sat_s,
                                "tokens_per_s_per_session": wl.tokens_per_s,
                                "cost_model": vars(cost), "cost_model_source": cost_source},
        "wall_definition": f">= {WALL_FRAMES} consecutive stalled_kv frames in one session "
                           f"(>= {WALL_FRAMES} s of silence while it streams)",
        "runs": [{k: v for k, v in r.items() if k != "series"} for r in runs],
        "collapsed": {p: f"{collapsed[p]}/{num_runs}" for p in policies},
        "collapsed_count": collapsed,
        "policies": list(policies),
        "peak_demand_blocks": demand,
        "wall_check": [{k: v for k, v in r.items() if k != "series"} for r in wall_runs],
        "paper": {"unbounded": "14/20", "bounded": "0/20"},
    }
    plots(ctx, runs, policies, wl)
    for r in wall_runs:
        if r["policy"] == "unbounded":
            panel(ctx, r, "wall_silent_failure_panel.png",
                  f"wall clock, SmolLM2 bf16, unbounded, seed {r['seed']}")
    return summary


def plots(ctx: RunContext, runs: list[dict], policies, wl: CliffWorkload) -> None:
    colors = {"unbounded": "tab:red", wl.bounded_policy: "tab:blue"}
    plt, save = ctx.figure("latency_over_time.png")
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for r in runs:
        s = r["series"]
        ax = axes[0] if r["policy"] == "unbounded" else axes[1]
        style = {"color": colors[r["policy"]], "alpha": 0.55, "linewidth": 1}
        ax.plot(s["t_s"], [None if v is None else v / 1e3 for v in s["user_latency_ms_p50"]],
                linestyle="-" if r["hit_wall"] else "--", **style)
    for ax, policy in zip(axes, policies, strict=True):
        walled = sum(r["hit_wall"] for r in runs if r["policy"] == policy)
        total = sum(r["policy"] == policy for r in runs)
        ax.set_title(f"{policy}: {walled}/{total} runs hit the wall "
                     "(solid: hit the wall, dashed: survived)", fontsize=10)
        ax.set_ylabel("user-perceived latency p50 (s)")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_yscale("log")
    axes[1].set_xlabel("time (s)")
    fig.suptitle("Frame latency as the user hears it (wait until the session next speaks), "
                 "one line per run", fontsize=10)
    save(fig)

    walled = [r for r in runs if r["policy"] == "unbounded" and r["hit_wall"]]
    if walled:
        panel(ctx, walled[0], "silent_failure_panel.png",
              f"virtual clock, unbounded, seed {walled[0]['seed']}")


def panel(ctx: RunContext, r: dict, name: str, title: str) -> None:
    """Standard metrics (green) next to goodput and the pool, for one run that hit the wall."""
    s = r["series"]
    plt, save = ctx.figure(name)
    fig, axes = plt.subplots(4, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(s["t_s"], [None if v is None else v / 1e3 for v in s["reported_latency_ms_p95"]],
                 color="tab:green")
    axes[0].axhline(1.0, color="grey", linestyle=":")
    axes[0].set_ylabel("reported p95\nlatency (s)")
    axes[0].set_ylim(0, 1.2)
    axes[1].plot(s["t_s"], s["deadline_met"], color="tab:green")
    axes[1].set_ylabel("deadline-met\nfraction")
    axes[1].set_ylim(0, 1.05)
    axes[2].plot(s["t_s"], s["goodput"], color="tab:red")
    axes[2].set_ylabel("goodput\n(frames with output)")
    axes[2].set_ylim(0, 1.05)
    axes[3].plot(s["t_s"], s["pool_fraction"], color="tab:purple")
    axes[3].set_ylabel("KV pool used")
    axes[3].set_ylim(0, 1.05)
    axes[3].set_xlabel("time (s)")
    if r["first_stall_s"] is not None:
        for ax in axes:
            ax.axvline(r["first_stall_s"], color="red", linestyle=":", linewidth=1)
    fig.suptitle(f"{title}: the standard metrics (green) stay healthy while goodput "
                 "collapses", fontsize=10)
    save(fig)


def report(summary: dict) -> str:
    wl, runs, policies = summary["workload"], summary["runs"], summary["policies"]
    lines = [
        f"# Cliff: {summary['num_runs']} runs x {{unbounded, bounded}}", "",
        describe(summary["provenance"]), "",
        f"Command: `{summary['command']}`. Clock: virtual: the engine runs every step for "
        "real (block pool, stalls, tokens) on a tiny random Llama; step time comes from the "
        f"cost model `{wl['cost_model_source']}`. The pool dynamics that decide the cliff do "
        f"not depend on the weights, and the {2 * summary['num_runs']} runs finish in minutes "
        "and repeat exactly.", "",
        f"Workload: {wl['sessions']} sessions opening uniformly over {wl['arrival_spread_s']:.0f}"
        f" s, each {wl['session_s']:.0f} s x U(1 ± {wl['jitter']}), one 1 s frame each second "
        f"({wl['tokens_per_frame']} input + {wl['output_tokens']} output tokens = "
        f"{wl['tokens_per_s_per_session']} KV tokens/s), deadline 1 s. Pool "
        f"{wl['pool_tokens']} tokens ({wl['pool_tokens'] // wl['block_size']} blocks of "
        f"{wl['block_size']}): the first-order t_sat (all sessions growing from the mean "
        f"arrival) is {wl['first_order_t_sat_s']:.0f} s, inside the spread of session "
        "durations, so saturation is a race. Bounded: "
        f"`{wl['bounded_policy']}`.", "",
        f"Hit the wall: {summary['wall_definition']}.", "",
        "| | unbounded | bounded | paper unbounded | paper bounded |", "|---|---|---|---|---|",
        f"| runs that hit the wall | {summary['collapsed'][policies[0]]} | "
        f"{summary['collapsed'][policies[1]]} | {summary['paper']['unbounded']} | "
        f"{summary['paper']['bounded']} |",
    ]
    for label, pick, spec in (("goodput, worst run", min, ".3f"),
                              ("goodput, mean over runs", fmean, ".3f")):
        cells = [fmt(pick(r["goodput"] for r in runs if r["policy"] == p), spec)
                 for p in policies]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | | |")
    for label, key, spec in (
                             ("deadline-met fraction, median", "deadline_met_fraction", ".3f"),
                             ("reported p95 latency ms, median", "latency_ms_p95", ".0f"),
                             ("peak pool use, median", "peak_pool_fraction", ".2f")):
        cells = [fmt(median(r[key] for r in runs if r["policy"] == p), spec) for p in policies]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | | |")
    unb = [r for r in runs if r["policy"] == policies[0]]
    predicted = sum(r["predicted_to_stall"] for r in unb)
    agree = sum(r["predicted_to_stall"] == (r["stalled_frames"] > 0) for r in unb)
    lines += [
        "", "Per run (unbounded):", "",
        "| seed | hit the wall | sessions hit | longest stall run | stalled frames | goodput |"
        " first stall s | peak demand > pool |", "|---|---|---|---|---|---|---|---|",
    ]
    for r in unb:
        lines.append(f"| {r['seed']} | {'yes' if r['hit_wall'] else 'no'} | "
                     f"{r['sessions_hit_wall']}/{r['sessions']} | "
                     f"{r['longest_stall_run_frames']} | {r['stalled_frames']} | "
                     f"{r['goodput']:.3f} | {fmt(r['first_stall_s'], '.1f')} | "
                     f"{'yes' if r['predicted_to_stall'] else 'no'} |")
    lines += [
        "", f"The peak-demand check (the seed's arrivals and durations replayed at block level "
        f"with an infinite pool) says {predicted}/{len(unb)} unbounded runs must stall; it "
        f"agrees with whether the engine stalled in {agree}/{len(unb)}. Which runs collapse "
        "is decided by the jitter of arrivals and durations alone: the metastable race.", "",
        "![latency over time](latency_over_time.png)", "",
    ]
    if any(r["hit_wall"] for r in unb):
        lines += ["![standard metrics vs goodput](silent_failure_panel.png)", ""]
    if summary["wall_check"]:
        virtual = {(r["policy"], r["seed"]): r for r in runs}
        lines += [
            "## Wall-clock check: the same seed on the real SmolLM2", "",
            "The same arrivals, durations and pool, on the wall clock with SmolLM2-135M bf16 "
            "streaming Hamlet text (real step times, real tokens).", "",
            "| policy | clock | hit the wall | sessions hit | stalled frames | first stall s | "
            "goodput | deadline met | reported p95 ms |", "|---|---|---|---|---|---|---|---|---|",
        ]
        for w in summary["wall_check"]:
            for clock, r in (("virtual", virtual[(w["policy"], w["seed"])]), ("wall", w)):
                lines.append(
                    f"| {r['policy']} | {clock} | {'yes' if r['hit_wall'] else 'no'} | "
                    f"{r['sessions_hit_wall']}/{r['sessions']} | {r['stalled_frames']} | "
                    f"{fmt(r['first_stall_s'], '.1f')} | {r['goodput']:.3f} | "
                    f"{r['deadline_met_fraction']:.3f} | {r['latency_ms_p95']:.0f} |")
        if any(w["policy"] == "unbounded" for w in summary["wall_check"]):
            lines += ["", "![wall clock panel](wall_silent_failure_panel.png)", ""]
    return "\n".join(lines) + "\n"
