"""`metronome experiment admission`: the AIMD controller on bounded vs unbounded KV.

Bounded (sinks + window): the offline sweep finds N* (largest fixed N with steady p95
latency <= 0.8 x deadline); AIMD, with sessions arriving faster than capacity, should find
the same N* online, and soon: the controller (slow start, then AIMD) runs beside the old
rule (+1 per interval from the start), with the intervals each took to reach 0.9 N*.
Unbounded, pool that fills: the latency signal stays flat until the pool
is dry, so AIMD keeps raising the cap and over-admits; what the pool can actually carry is
found by sweeping a *static* cap over the same arrival stream for the largest cap under which
no frame ever stalls on KV (the memory N*).

Clock: virtual (real engine steps on a tiny random Llama, SmolLM2-fitted step times): the
sweep needs dozens of runs, each minutes of session time, and must repeat exactly. The wall
clock version on the real SmolLM2 is `metronome bench admission` (docs/results/admission.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from metronome.admission.limits import StaticLimit
from metronome.experiments.common import STEP_COST_HELP, VIRTUAL_CLOCK, cost_model
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import random_model
from metronome.results.context import RunContext
from metronome.results.plots import plot_cap_history as plot_run
from metronome.results.provenance import describe
from metronome.results.tables import fmt
from metronome.sim.admission import UNBOUNDED_SESSION_S, virtual_runs, workload_sentence
from metronome.sim.scenario import Scenario, run_controlled
from metronome.sim.search import largest_passing
from metronome.stream import FrameStatus

NAME = "admission"
REQUIRED_FIELDS = ("bounded", "bounded_linear", "unbounded", "sweep", "memory_sweep", "paper")


@dataclass(frozen=True)
class Config:
    duration_s: float = field(default=240.0, metadata={"help": "length of each AIMD run"})
    sweep_max_sessions: int = field(default=256, metadata={
        "help": "largest N the offline N* sweep may try"})
    memory_max_cap: int = field(default=64, metadata={
        "help": "largest static cap the memory N* sweep may try"})
    step_cost: str | None = field(default=None, metadata={"help": STEP_COST_HELP})

    @classmethod
    def smoke(cls) -> Config:
        return cls(duration_s=60.0, sweep_max_sessions=64)


def memory_n_star(scenario: Scenario, duration_s: float, n_max: int, advance) -> tuple[int, list]:
    """Largest static cap whose run never stalls on KV (same arrivals as the AIMD run)."""
    table: dict[int, int] = {}

    def ok(n: int) -> bool:
        run = run_controlled(scenario, StaticLimit(n), duration_s, session_s=UNBOUNDED_SESSION_S)
        table[n] = sum(r.status is FrameStatus.STALLED_KV for r in run.results)
        advance()
        return table[n] == 0

    n_star = largest_passing(ok, n_max)
    return n_star, [{"cap": n, "stalled_frames": table[n]} for n in sorted(table)]


def _against_swept(b: dict) -> dict:
    """A bounded run's summary with what it found online beside the swept N*."""
    mean, n_star = b["steady_cap_mean"], b["n_star"]
    return b | {"swept_n_star": n_star, "discovered_n_star": mean,
                "discovered_over_swept": mean / n_star if n_star and mean else None}


def run(ctx: RunContext, cfg: Config) -> dict:
    cost, cost_source = cost_model(cfg.step_cost)
    ctx.log(f"admission: offline N* sweep and AIMD runs (step cost from {cost_source})")
    with ctx.progress("admission: sweep + AIMD runs", 1) as advance:
        v = virtual_runs(cost, cfg.duration_s, cfg.sweep_max_sessions)
        advance()
    model = random_model(TINY_LLAMA, torch.float32)
    unbounded = Scenario(model, cost, policy="unbounded", pool_tokens=v["unbounded_pool_tokens"])
    with ctx.progress("admission: memory N* sweep (unbounded, static caps)", None) as advance:
        mem_n, mem_table = memory_n_star(unbounded, v["duration_s"], cfg.memory_max_cap,
                                          advance)
    b, u = v["bounded"], v["unbounded"]
    b, linear = (_against_swept(run) for run in (b, v["bounded_linear"]))
    u_caps = [h["cap"] for h in u["history"]]
    saturated = u["saturated_at_s"]
    cap_at_saturation = next((h["cap"] for h in reversed(u["history"])
                              if saturated is not None and h["at_s"] <= saturated), None)
    ctx.record(model="tiny random Llama (virtual clock)", dtype="float32")
    summary = {
        "experiment": NAME, "clock": VIRTUAL_CLOCK, "workload": v["workload"],
        "bounded": b, "bounded_linear": linear,
        "unbounded": u | {
            "memory_n_star": mem_n, "max_cap": max(u_caps, default=None),
            "cap_at_saturation": cap_at_saturation,
            "over_admission": (max(u_caps) / mem_n) if u_caps and mem_n else None,
            "pool_tokens": v["unbounded_pool_tokens"]},
        "sweep": v["sweep"], "memory_sweep": mem_table, "duration_s": v["duration_s"],
        "cost_model": vars(cost), "cost_model_source": cost_source,
        "paper": {"bounded": "finds N* ~ 209 (deadline binds; ~500 fit in memory)",
                  "unbounded": "over-admits into the wall"},
    }
    plot_run(f"bounded ({v['workload']['bounded_policy']}): AIMD vs swept N*", b, b["n_star"],
             ctx.plot_path("aimd_bounded.png"))
    plot_run(f"unbounded, pool {v['unbounded_pool_tokens']} tokens: AIMD over-admits "
             f"(memory N* = {mem_n})", u, mem_n, ctx.plot_path("aimd_unbounded.png"))
    return summary


def _convergence_row(name: str, b: dict) -> str:
    never = b["convergence_intervals"] is None
    return (f"| {name} | {'not reached' if never else b['convergence_intervals']} | "
            f"{'-' if never else fmt(b['convergence_s'], '.0f')} | {b['peak_cap']} | "
            f"{fmt(b['miss_rate_before_convergence'], '.2%')} | "
            f"{fmt(b['discovered_n_star'], '.1f')} ({b['steady_cap_min']}..{b['steady_cap_max']})"
            f" | {fmt(b['discovered_over_swept'], '.2f')} |")


def report(s: dict) -> str:
    b, u, w = s["bounded"], s["unbounded"], s["workload"]
    lines = [
        "# Admission: AIMD on bounded vs unbounded KV", "",
        describe(s["provenance"]), "",
        f"Command: `{s['command']}`. Clock: virtual (real engine steps on a tiny random "
        f"Llama; step time from the cost model `{s['cost_model_source']}`), so the sweeps "
        f"repeat exactly. {workload_sentence(w, s['duration_s'])}", "",
        "| | swept N* | AIMD cap, 2nd half mean (min..max) | AIMD / swept | stalled frames |"
        " goodput |", "|---|---|---|---|---|---|",
        f"| bounded {w['bounded_policy']} (latency N*) | {b['swept_n_star']} | "
        f"{fmt(b['discovered_n_star'], '.1f')} ({b['steady_cap_min']}..{b['steady_cap_max']}) |"
        f" {fmt(b['discovered_over_swept'], '.2f')} | {b['stalled_frames']} | "
        f"{b['goodput']:.1%} |",
        f"| unbounded, pool {u['pool_tokens']} tokens (memory N*) | {u['memory_n_star']} | "
        f"{fmt(u['steady_cap_mean'], '.1f')} ({u['steady_cap_min']}..{u['steady_cap_max']}) |"
        f" {fmt(u['over_admission'], '.2f')} (max cap) | {u['stalled_frames']} | "
        f"{u['goodput']:.1%} |", "",
        f"Convergence from a cold cap of 4 (bounded, swept N* = {b['swept_n_star']}; control "
        f"interval {w['interval_s']:g} s):", "",
        "| rule | intervals to 0.9 N* | seconds | peak cap | misses before | cap, 2nd half mean "
        "(min..max) | / swept |", "|---|---|---|---|---|---|---|",
    ]
    lines += [_convergence_row(name, run) for name, run in (
        ("slow start, then AIMD (now)", b), ("AIMD +1 from the start (before)",
                                              s["bounded_linear"]))]
    lines += [
        "",
        f"Unbounded: AIMD raised the cap to {u['max_cap']} although at most "
        f"{u['memory_n_star']} sessions fit the pool over this arrival stream "
        f"(over-admission {fmt(u['over_admission'], '.1f')}x); the pool ran dry at t = "
        f"{fmt(u['saturated_at_s'], '.1f')} s with the cap at {u['cap_at_saturation']}. "
        "Its latency signal was flat until then, so nothing told it to stop.", "",
        f"Paper: bounded, AIMD {s['paper']['bounded']}; unbounded, it "
        f"{s['paper']['unbounded']}. The absolute N* is the machine's and the step cost "
        "model's.", "",
        "Latency sweep (bounded, fixed N, no admission):", "",
        "| N | p95 latency / deadline | miss rate |", "|---|---|---|",
    ]
    lines += [f"| {r['sessions']} | {r['p95_fraction']:.3f} | {r['miss_rate']:.3f} |"
              for r in s["sweep"]]
    lines += ["", "Memory sweep (unbounded, static cap, same arrivals):", "",
              "| cap | stalled frames |", "|---|---|"]
    lines += [f"| {r['cap']} | {r['stalled_frames']} |" for r in s["memory_sweep"]]
    lines += ["", "![bounded](aimd_bounded.png)", "", "![unbounded](aimd_unbounded.png)", ""]
    return "\n".join(lines)

