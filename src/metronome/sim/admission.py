"""AIMD against the swept N* on the virtual clock: the runs `metronome bench admission` and
`metronome experiment admission` share, condensed to the numbers both report, and the one
sentence both use to state the workload those runs had (read from their result).

The controller is the server's (`SlowStartLimit`: AIMD after a slow start); the bounded run
is repeated with the old rule (`AIMDLimit`: +1 per interval from the start) for the
convergence time side by side."""

from __future__ import annotations

import sys
from statistics import fmean

import torch

from metronome.admission.limits import AIMDLimit, SlowStartLimit
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import random_model
from metronome.sim.scenario import Scenario, run_controlled, sweep_n_star
from metronome.stream import FrameStatus
from metronome.workload_defaults import EXPERIMENT_POLICY_SPEC


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def summarize(run, n_star: int | None, converged_s: float) -> dict:
    steady = [s.cap for s in run.history if s.at_s >= converged_s]
    after = [r for r in run.results if r.arrival_s >= converged_s]
    reach = None  # (interval, at_s) of the first cap >= 0.9 N*
    if n_star:
        reach = next(((i + 1, s.at_s) for i, s in enumerate(run.history)
                      if s.cap >= 0.9 * n_star), None)
    # frames until the cap reached 0.9 N* (all of them if it never did)
    before = [] if not n_star else [r for r in run.results
                                    if reach is None or r.arrival_s < reach[1]]
    return {
        "n_star": n_star,
        "steady_cap_mean": fmean(steady) if steady else None,
        "steady_cap_min": min(steady, default=None), "steady_cap_max": max(steady, default=None),
        "convergence_s": None if reach is None else reach[1],
        "convergence_intervals": None if reach is None else reach[0],
        "miss_rate_before_convergence": (
            sum(not r.deadline_met for r in before) / len(before) if before else None
        ),
        "peak_cap": max((s.cap for s in run.history), default=None),
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


# The arrival stream of the AIMD runs: sessions arrive faster than capacity.
ARRIVAL_EVERY_S = 0.25
BOUNDED_SESSION_S = 30.0
UNBOUNDED_SESSION_S = 60.0  # long enough that the pool runs dry mid-run
DURATION_JITTER = 0.3
INTERVAL_S = 2.0  # the controller's control interval
UNBOUNDED_POOL_TOKENS = 40 * 8 * 16


def virtual_runs(cost, duration_s: float, n_max: int) -> dict:
    """The offline N* sweep (fixed N up to `n_max`), then AIMD bounded and unbounded (a pool
    that fills) for `duration_s`; the workload they ran is in the result's `workload`."""
    model = random_model(TINY_LLAMA, torch.float32)
    bounded = Scenario(model, cost, policy=EXPERIMENT_POLICY_SPEC)
    log("virtual: sweeping N* (bounded)")
    n_star, table = sweep_n_star(bounded, n_max=n_max)
    log(f"virtual: N* = {n_star}; AIMD bounded run")
    stream = {"arrival_every_s": ARRIVAL_EVERY_S, "jitter": DURATION_JITTER,
              "interval_s": INTERVAL_S}
    run_b = run_controlled(bounded, SlowStartLimit(initial_cap=4), duration_s,
                           session_s=BOUNDED_SESSION_S, **stream)
    log("virtual: the old rule (+1 per interval from the start), bounded")
    run_linear = run_controlled(bounded, AIMDLimit(initial_cap=4), duration_s,
                                session_s=BOUNDED_SESSION_S, **stream)
    unbounded = Scenario(model, cost, policy="unbounded", pool_tokens=UNBOUNDED_POOL_TOKENS)
    log("virtual: AIMD unbounded run (pool fills)")
    run_u = run_controlled(unbounded, SlowStartLimit(initial_cap=4), duration_s,
                           session_s=UNBOUNDED_SESSION_S, **stream)
    profile = bounded.profile()
    workload = {
        "bounded_policy": bounded.policy, "frame_period_s": profile.frame_period_s,
        "deadline_s": profile.frame_period_s * profile.deadline_fraction,
        "input_tokens_per_frame": bounded.tokens_per_frame,
        "output_tokens_per_frame": bounded.output_tokens,
        "target_fraction": bounded.target_fraction, "bounded_session_s": BOUNDED_SESSION_S,
        "unbounded_session_s": UNBOUNDED_SESSION_S} | stream
    return {"sweep": table, "bounded": summarize(run_b, n_star, duration_s / 2),
            "bounded_linear": summarize(run_linear, n_star, duration_s / 2),
            "unbounded": summarize(run_u, None, duration_s / 2),
            "unbounded_pool_tokens": unbounded.pool_tokens, "duration_s": duration_s,
            "workload": workload}


def workload_sentence(w: dict, duration_s: float) -> str:
    """The AIMD runs' workload as the admission reports state it (bench and experiment)."""
    return (f"Sessions: {w['frame_period_s']:g} s frames of {w['input_tokens_per_frame']} "
            f"input + {w['output_tokens_per_frame']} output tokens, deadline "
            f"{w['deadline_s']:g} s, ~{w['bounded_session_s']:.0f} s long bounded "
            f"(~{w['unbounded_session_s']:.0f} s unbounded; jitter {w['jitter']:.0%}), "
            f"arriving every {w['arrival_every_s']:g} s (faster than capacity) for "
            f"{duration_s:.0f} s; AIMD target p95 latency <= {w['target_fraction']:g} x "
            f"deadline, control interval {w['interval_s']:g} s.")
