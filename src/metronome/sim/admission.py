"""AIMD against the swept N* on the virtual clock: the runs `metronome bench admission` and
`metronome experiment admission` share, condensed to the numbers both report."""

from __future__ import annotations

import sys
from statistics import fmean

import torch

from metronome.admission.limits import AIMDLimit
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import random_model
from metronome.runtime.frame import FrameStatus
from metronome.sim.scenario import Scenario, run_controlled, sweep_n_star


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
