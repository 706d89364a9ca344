"""Cold-start convergence of the admission cap on the virtual clock, at swept N* of ~10, ~40
and ~200 (the packaged step cost model with its per-token and per-key costs scaled), and a
sudden loss of capacity (the step cost doubles mid-run)."""

from __future__ import annotations

from statistics import fmean

import pytest

from metronome.admission.limits import AIMDLimit, SlowStartLimit
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.sim.scenario import Scenario, run_controlled, sweep_n_star
from metronome.workload_defaults import EXPERIMENT_POLICY_SPEC

INTERVAL_S = 2.0
DURATION_S = 60.0
SWEEP = {"duration_s": 30.0, "warmup_s": 10.0}


def scaled_cost(scale: float) -> StepCostModel:
    """The packaged model with each session's work (per token, per key) x `scale`."""
    base = StepCostModel.load(PACKAGED_STEP_COST)[0]
    return StepCostModel(base.fixed_s, base.per_token_s * scale,
                         base.per_context_token_s * scale)


def scenario(tiny_model, scale: float) -> Scenario:
    return Scenario(tiny_model, scaled_cost(scale), policy=EXPERIMENT_POLICY_SPEC)


def intervals_to_reach(run, n_star: int) -> int | None:
    return next((i + 1 for i, s in enumerate(run.history) if s.cap >= 0.9 * n_star), None)


def miss_rate(results) -> float:
    return sum(not r.deadline_met for r in results) / len(results)


# (work scale, arrival every s, N* range): arrivals outpace 10 intervals' worth of N*
CASES = {"~10": (2.7, 0.25, (7, 14)), "~40": (0.68, 0.1, (32, 50)),
         "~200": (0.14, 0.05, (170, 240))}


@pytest.mark.parametrize("case", list(CASES))
def test_cold_start_reaches_n_star_within_10_intervals(tiny_model, case):
    scale, arrival_every_s, (low, high) = CASES[case]
    s = scenario(tiny_model, scale)
    n_star, table = sweep_n_star(s, n_max=high, **SWEEP)
    assert low <= n_star < high, table
    run = run_controlled(s, SlowStartLimit(initial_cap=4), DURATION_S,
                         arrival_every_s=arrival_every_s, interval_s=INTERVAL_S)
    reached = intervals_to_reach(run, n_star)
    steady = [h.cap for h in run.history[reached:]] if reached else []
    print(f"N* = {n_star}: 0.9 N* after {reached} intervals, then cap mean "
          f"{fmean(steady):.1f} ({min(steady)}..{max(steady)}), misses "
          f"{miss_rate(run.results):.2%}")
    assert reached is not None and reached <= 10, [h.cap for h in run.history]
    assert miss_rate(run.results) < 0.01
    assert abs(fmean(steady) - n_star) <= 0.1 * n_star, (steady, n_star)
    assert max(steady) <= 1.2 * n_star, (steady, n_star)  # no overshoot that lingers


def test_linear_increase_is_what_slow_start_replaces(tiny_model):
    scale, arrival_every_s, _ = CASES["~200"]
    run = run_controlled(scenario(tiny_model, scale), AIMDLimit(initial_cap=4), 20.0,
                         arrival_every_s=arrival_every_s, interval_s=INTERVAL_S)
    assert [h.cap for h in run.history] == list(range(5, 15))  # +1 per interval


def test_a_sudden_loss_of_capacity_is_followed_within_5_intervals(tiny_model):
    scale, arrival_every_s, _ = CASES["~40"]
    n_star_after, table = sweep_n_star(scenario(tiny_model, 2 * scale), n_max=26, **SWEEP)
    assert 14 <= n_star_after < 26, table
    drop_s = 60.0
    run = run_controlled(scenario(tiny_model, scale), SlowStartLimit(initial_cap=4), 120.0,
                         arrival_every_s=arrival_every_s, interval_s=INTERVAL_S,
                         cost_change=(drop_s, scaled_cost(2 * scale)))
    after = [h for h in run.history if h.at_s > drop_s]
    caps = [h.cap for h in after]
    print(f"N* after the drop {n_star_after}: caps {caps}")
    assert after[0].misses > 0  # the drop was felt
    assert caps[4] <= 1.1 * n_star_after, caps  # 5 intervals after the drop
    settled = caps[10:]
    assert abs(fmean(settled) - n_star_after) <= 0.1 * n_star_after, caps
    late = [r for r in run.results if r.arrival_s >= drop_s + 10 * INTERVAL_S]
    assert miss_rate(late) < 0.01
