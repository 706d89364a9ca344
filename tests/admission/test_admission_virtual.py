"""AIMD admission on the virtual clock with a step-cost model fitted from `metronome bench
engine`: it finds N* when KV is bounded, and over-admits into the wall when it is not."""

from __future__ import annotations

from statistics import fmean

import pytest

from metronome.admission.limits import AIMDLimit, SlowStartLimit
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.sim.scenario import Scenario, run_controlled, sweep_n_star
from metronome.stream import FrameStatus

DURATION_S = 160.0
CONVERGED_S = 80.0


@pytest.fixture(scope="module")
def cost():
    return StepCostModel.load(PACKAGED_STEP_COST)[0]  # fitted from `metronome bench engine`


@pytest.fixture(scope="module")
def bounded(tiny_model, cost):
    scenario = Scenario(tiny_model, cost, policy="sinks_window:4:128")
    n_star, table = sweep_n_star(scenario, n_max=128)
    run = run_controlled(scenario, AIMDLimit(initial_cap=4), DURATION_S)
    return n_star, table, run


def test_aimd_converges_to_swept_n_star(bounded):
    n_star, table, run = bounded
    assert 4 < n_star < 128, table
    steady_caps = [s.cap for s in run.history if s.at_s >= CONVERGED_S]
    mean_cap = fmean(steady_caps)
    print(f"N* = {n_star}; steady cap mean {mean_cap:.1f}, range "
          f"{min(steady_caps)}..{max(steady_caps)}")
    assert abs(mean_cap - n_star) <= 0.1 * n_star, (mean_cap, n_star)


def test_admitted_sessions_meet_deadlines_after_convergence(bounded):
    _, _, run = bounded
    after = [r for r in run.results if r.arrival_s >= CONVERGED_S]
    misses = sum(not r.deadline_met for r in after)
    assert after and misses / len(after) <= 0.01, (misses, len(after))
    assert not any(r.status is FrameStatus.STALLED_KV for r in run.results)
    assert run.counts["refused:at_capacity"] > 0  # arrivals did exceed capacity


@pytest.mark.parametrize("limit", [AIMDLimit, SlowStartLimit])
def test_unbounded_kv_makes_aimd_over_admit_into_the_wall(tiny_model, cost, limit):
    # a pool that holds ~40 sessions' first 8 s: latency stays flat while it fills
    scenario = Scenario(tiny_model, cost, policy="unbounded", pool_tokens=40 * 8 * 16,
                        output_tokens=4)
    run = run_controlled(scenario, limit(initial_cap=4), 60.0, session_s=60.0)
    assert run.saturated_at_s is not None, "the pool never filled"
    before = [s for s in run.history if s.at_s < run.saturated_at_s]
    # the cap climbed all the way while the latency signal looked fine ...
    assert before[-1].cap > before[0].cap + 5
    assert all(s.misses == 0 and s.stalled == 0 for s in before)
    # ... then admitted sessions stalled: the over-admission the paper describes
    after = [r for r in run.results if r.finish_s >= run.saturated_at_s]
    stalled = sum(r.status is FrameStatus.STALLED_KV for r in after)
    assert stalled / len(after) > 0.3, (stalled, len(after))
