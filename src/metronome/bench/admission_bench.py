"""`metronome bench admission`: the AIMD controller against the offline N* sweep.

1. Virtual clock (deterministic): engine steps are real steps of our engine on a tiny random
   Llama; step *time* comes from the cost model fitted from `metronome bench engine`
   (SmolLM2, this CPU), so the latency curve is SmolLM2's. Bounded (sinks_window 4+128):
   offline sweep for N* (largest N with steady p95 latency <= 0.8 x deadline), then AIMD
   with sessions arriving faster than capacity. Unbounded with a pool that fills: the same
   controller over-admits while latency is flat, then sessions stall.
2. Wall clock on the real SmolLM2 (bf16): AIMD with arrivals faster than capacity.
Writes JSON, PNG plots and `docs/results/admission.md`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from statistics import fmean

import torch

from metronome.admission.controller import AdmissionController
from metronome.admission.limits import AIMDLimit
from metronome.harness.scenario import Scenario, run_controlled, sweep_n_star
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import random_model
from metronome.runtime.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.runtime.frame import FrameStatus


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def summarize(run, n_star: int | None, converged_s: float) -> dict:
    steady = [s.cap for s in run.history if s.at_s >= converged_s]
    after = [r for r in run.results if r.arrival_s >= converged_s]
    reach = None
    if n_star:
        reach = next((s.at_s for s in run.history if s.cap >= 0.9 * n_star), None)
    return {
        "n_star": n_star,
        "steady_cap_mean": fmean(steady) if steady else None,
        "steady_cap_min": min(steady, default=None), "steady_cap_max": max(steady, default=None),
        "convergence_s": reach,
        "miss_rate_after_convergence": (
            sum(not r.deadline_met for r in after) / len(after) if after else None
        ),
        "stalled_frames": sum(r.status is FrameStatus.STALLED_KV for r in run.results),
        "frames": len(run.results),
        "goodput": sum(r.good for r in run.results) / max(1, len(run.results)),
        "counts": run.counts,
        "saturated_at_s": run.saturated_at_s,
        "history": [vars(s) for s in run.history],
    }


def virtual_runs(cost, smoke: bool) -> dict:
    model = random_model(TINY_LLAMA, torch.float32)
    duration_s = 60.0 if smoke else 240.0
    bounded = Scenario(model, cost, policy="sinks_window:4:128")
    log("virtual: sweeping N* (bounded)")
    n_star, table = sweep_n_star(bounded, n_max=64 if smoke else 256)
    log(f"virtual: N* = {n_star}; AIMD bounded run")
    run_b = run_controlled(bounded, AIMDLimit(initial_cap=4), duration_s)
    unbounded = Scenario(model, cost, policy="unbounded", pool_tokens=40 * 8 * 16)
    log("virtual: AIMD unbounded run (pool fills)")
    run_u = run_controlled(unbounded, AIMDLimit(initial_cap=4), duration_s, session_s=60.0)
    return {"sweep": table, "bounded": summarize(run_b, n_star, duration_s / 2),
            "unbounded": summarize(run_u, None, duration_s / 2),
            "unbounded_pool_tokens": unbounded.pool_tokens, "duration_s": duration_s}


async def _wall_run(duration_s: float, arrival_every_s: float) -> dict:
    from metronome.engine.engine import Engine, EngineConfig
    from metronome.kv.residency import ResidencyPolicy
    from metronome.model.weights import DTYPES, load_model, load_tokenizer
    from metronome.runtime.local import text_source
    from metronome.runtime.profile import SessionProfile
    from metronome.runtime.wall import WallDriver
    from metronome.runtime.workload import Workload, schedule

    model = load_model("bundled", DTYPES["bfloat16"])
    engine = Engine(model, EngineConfig(block_size=16, pool_tokens=65536))
    results = []

    def on_result(result):
        results.append(result)
        controller.observe(result)

    driver = WallDriver(engine, on_result)
    controller = AdmissionController(AIMDLimit(initial_cap=2), lambda: len(driver.beat.sessions))
    profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=4,
                             policy=ResidencyPolicy.sinks_window(4, 128))
    workload = Workload(int(duration_s / arrival_every_s), 30.0, arrival_spread_s=duration_s,
                        duration_jitter=0.3)
    source = text_source(load_tokenizer(), model.config.vocab_size, 12)
    schedule(workload, profile, driver.beat, driver.clock, source, gate=controller.try_admit)
    controller.start(driver.clock)
    try:
        while driver.now_s() < duration_s:
            await asyncio.sleep(5)
            last = controller.history[-1] if controller.history else None
            log(f"wall: t={driver.now_s():.0f}s cap={last and last.cap} "
                f"active={len(driver.beat.sessions)} frames={len(results)}")
    finally:
        driver.close()

    class Run:  # the shape summarize() reads
        history, counts, saturated_at_s = controller.history, dict(controller.counts), None

    Run.results = results
    return summarize(Run, None, duration_s / 2)


def plot(name: str, summary: dict, n_star: int | None, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = summary["history"]
    t = [h["at_s"] for h in history]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ax1.plot(t, [h["cap"] for h in history], label="admission cap")
    ax1.plot(t, [h["active_sessions"] for h in history], label="active sessions")
    if n_star:
        ax1.axhline(n_star, color="grey", linestyle="--", label=f"swept N* = {n_star}")
    if summary.get("saturated_at_s"):
        for ax in (ax1, ax2):
            ax.axvline(summary["saturated_at_s"], color="red", linestyle=":",
                       label="pool saturated")
    ax1.set_ylabel("sessions")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.plot(t, [h["p95_latency_fraction"] for h in history], color="tab:purple",
             label="p95 latency / deadline")
    ax2.plot(t, [h["stalled"] / max(1, h["frames"]) for h in history], color="tab:red",
             label="stalled_kv share of frames")
    ax2.axhline(0.8, color="grey", linestyle="--", label="target 0.8")
    ax2.set_xlabel("time (s)")
    ax2.legend(loc="upper left", fontsize=8)
    ax1.set_title(name)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def run(out_md: str, out_json: str, smoke: bool, wall: bool = True) -> dict:
    started = time.time()
    cost, _ = StepCostModel.load(PACKAGED_STEP_COST)
    results = {"cost_model": vars(cost), "virtual": virtual_runs(cost, smoke)}
    if wall:
        log("wall clock: SmolLM2, AIMD, arrivals faster than capacity")
        results["wall"] = asyncio.run(_wall_run(40.0 if smoke else 150.0, 0.5))
    figures = Path(out_md).with_suffix("")
    figures.mkdir(parents=True, exist_ok=True)
    v = results["virtual"]
    plot("virtual clock, bounded (sinks_window 4+128)", v["bounded"], v["bounded"]["n_star"],
         figures / "virtual_bounded.png")
    plot("virtual clock, unbounded KV, pool fills", v["unbounded"], None,
         figures / "virtual_unbounded.png")
    if wall:
        plot("wall clock, SmolLM2 bf16, bounded", results["wall"], None, figures / "wall.png")
    results["elapsed_s"] = time.time() - started
    Path(out_json).write_text(json.dumps(results, indent=2, default=str))
    Path(out_md).write_text(render(results, figures.name, smoke))
    return results


TABLE_HEAD = ("| run | swept N* | cap mean in 2nd half (min..max) | time to 90 % of N* | misses "
              "in 2nd half | stalled frames | goodput | admitted / refused |")
TABLE_RULE = "|---|---|---|---|---|---|---|---|"


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(r: dict, figures: str, smoke: bool) -> str:
    v, cost = r["virtual"], r["cost_model"]
    b, u = v["bounded"], v["unbounded"]
    lines = [
        "# Admission: AIMD against the swept N*", "",
        f"Generated by `metronome bench admission{' --smoke' if smoke else ''}` in "
        f"{r['elapsed_s']:.0f} s. Written by the command; do not edit by hand.", "",
        "## Virtual clock", "",
        "Engine steps are real steps of our engine (tiny random Llama); step time comes from "
        "the cost model fitted from `docs/results/engine.json` (SmolLM2 bf16 on this CPU): "
        f"`step_s = {cost['fixed_s']:.4f} + {cost['per_token_s']:.5f} x tokens + "
        f"{cost['per_context_token_s']:.2e} x context tokens`. Sessions: 1 s frames, 12 input "
        "+ 4 output tokens, deadline 1 s, ~30 s long (jitter 30 %), arriving every 0.25 s "
        f"(faster than capacity) for {v['duration_s']:.0f} s. Target: p95 latency <= 0.8 x "
        "deadline; control interval 2 s.", "",
        TABLE_HEAD, TABLE_RULE,
        _row("bounded sinks_window 4+128", b),
        _row(f"unbounded, pool {v['unbounded_pool_tokens']} tokens", u),
        "", "Offline sweep (fixed N, no admission; steady-state p95 of latency / deadline):", "",
        "| N | p95 latency / deadline | miss rate |", "|---|---|---|",
    ]
    lines += [f"| {s['sessions']} | {s['p95_fraction']:.3f} | {s['miss_rate']:.3f} |"
              for s in v["sweep"]]
    lines += ["", f"![bounded]({figures}/virtual_bounded.png)", "",
              f"![unbounded]({figures}/virtual_unbounded.png)", ""]
    if u.get("saturated_at_s"):
        before = [h for h in u["history"] if h["at_s"] < u["saturated_at_s"]]
        signals = sum(h["misses"] + h["stalled"] for h in before)
        lines.append(
            f"Unbounded: the pool saturated at t = {u['saturated_at_s']:.1f} s with the cap at "
            f"{before[-1]['cap'] if before else '-'}, after {signals} deadline-miss or stall "
            "signals; afterwards admitted sessions stalled (they are never evicted).")
    if "wall" in r:
        lines += ["", "## Wall clock, SmolLM2 bf16 (bounded 4+128, arrivals every 0.5 s)", "",
                  TABLE_HEAD, TABLE_RULE, _row("wall clock", r["wall"]),
                  "", f"![wall]({figures}/wall.png)", ""]
    return "\n".join(lines) + "\n"


def _row(name: str, s: dict) -> str:
    return (f"| {name} | {s['n_star'] or '-'} | {_f(s['steady_cap_mean'], '.1f')} "
            f"({s['steady_cap_min']}..{s['steady_cap_max']}) | {_f(s['convergence_s'], '.0f')} s "
            f"| {_f(s['miss_rate_after_convergence'], '.2%')} | {s['stalled_frames']} "
            f"| {s['goodput']:.1%} | {s['counts'].get('admitted', 0)} / "
            f"{s['counts'].get('refused:at_capacity', 0)} |")
