"""Exact tests of the admission update rules: one sample in, exact cap out."""

from __future__ import annotations

import pytest

from metronome.admission.limits import (
    AIMDLimit,
    IntervalSample,
    SlowStartLimit,
    StaticLimit,
    make_limit,
)


def sample(p95=0.5, misses=0, stalled=0, active=30, frames=20):
    # frames latency fractions whose 95th percentile is p95
    return IntervalSample([0.1] * (frames - 2) + [p95] * 2, misses, stalled, active)


def test_increase_when_under_target_and_pressing_on_the_cap():
    limit = AIMDLimit(initial_cap=20)
    assert limit.update(sample(p95=0.5, active=20)) == 21


def test_no_increase_while_below_the_cap():
    limit = AIMDLimit(initial_cap=20)
    assert limit.update(sample(p95=0.5, active=19)) == 20  # an untested cap is not raised
    assert limit.update(sample(p95=0.5, active=20)) == 21
    netflix = AIMDLimit(initial_cap=20, near_cap_fraction=0.5)
    assert netflix.update(sample(p95=0.5, active=9)) == 20
    assert netflix.update(sample(p95=0.5, active=10)) == 21  # inflight * 2 >= limit


def test_decrease_when_over_target():
    limit = AIMDLimit(initial_cap=30)
    assert limit.update(sample(p95=0.81)) == 27  # floor(30 * 0.9)
    assert limit.update(sample(p95=0.8, active=27)) == 28  # at target is not over
    assert AIMDLimit(initial_cap=20).update(sample(p95=0.9, active=20)) == 18


def test_hold_while_a_cut_is_still_pending():
    limit = AIMDLimit(initial_cap=30)
    assert limit.update(sample(p95=0.9, active=30)) == 27
    assert limit.update(sample(p95=0.9, active=30)) == 27  # 30 > 27: the cut has not bitten
    assert limit.update(sample(p95=0.9, active=27)) == 24


@pytest.mark.parametrize("signal", [{"misses": 1}, {"stalled": 1}])
def test_misses_and_kv_stalls_count_as_over_target(signal):
    limit = AIMDLimit(initial_cap=30)
    assert limit.update(sample(p95=0.1, **signal)) == 27


def test_floor_at_min_cap():
    limit = AIMDLimit(initial_cap=2, min_cap=2)
    assert limit.update(sample(p95=5.0, active=2)) == 2
    limit = AIMDLimit(initial_cap=1)
    assert limit.update(sample(p95=5.0, active=1)) == 1


def test_no_frames_no_signal():
    limit = AIMDLimit(initial_cap=7)
    assert limit.update(IntervalSample([], 0, 0, 7)) == 7


def test_max_cap_and_percentile():
    limit = AIMDLimit(initial_cap=10, max_cap=10)
    assert limit.update(sample(active=10)) == 10
    s = IntervalSample([i / 100 for i in range(1, 101)], 0, 0, 1)
    assert s.percentile(95) == 0.95 and s.percentile(50) == 0.50


def test_static_and_off():
    assert StaticLimit(8).update(sample(p95=9, misses=3)) == 8
    assert make_limit("off").update(sample(p95=9)) >= 2**30
    with pytest.raises(ValueError, match="aimd"):
        make_limit("pid")
    with pytest.raises(ValueError):
        AIMDLimit(decrease=1.5)


def test_slow_start_grows_to_the_n_star_the_latency_predicts():
    limit = SlowStartLimit(initial_cap=4)
    assert limit.update(sample(p95=0.3, active=4)) == 8  # p0 = 0.3: no load yet, doubles
    # latency ~ p0 / (1 - n / M): 0.55 at 8 gives M = 8 / (1 - 0.3 / 0.55) = 17.6, and the
    # load at the 0.8 target M (1 - 0.3 / 0.8) = 11.0
    assert limit.update(sample(p95=0.55, active=8)) == 11
    assert limit.update(sample(p95=0.3, active=10)) == 11  # not binding: not raised
    # the latency came from a mean of 10 sessions, not the 11 at the interval's end
    limit.update(IntervalSample([0.3] * 20, 0, 0, 11, mean_active_sessions=10.0))
    assert limit.cap == 20
    assert limit.update(sample(p95=0.79, active=20)) == 21  # near the target: + increase


def test_slow_start_ends_at_the_first_over_target_signal():
    limit = SlowStartLimit(initial_cap=10)
    assert limit.update(sample(p95=0.3, active=10)) == 20
    assert limit.update(sample(p95=0.85, active=20)) == 18  # AIMD's cut
    assert not limit.slow_start
    assert limit.update(sample(p95=0.3, active=18)) == 19  # AIMD from now on: + 1


def test_severe_misses_cut_even_while_a_cut_is_pending():
    limit = SlowStartLimit(initial_cap=30)
    assert limit.update(sample(p95=1.0, misses=1, active=30)) == 27
    # 2 misses of 20 frames (10 % >= 5 %): admitted sessions are hurt now, cut again
    assert limit.update(sample(p95=1.0, misses=2, active=30)) == 24
    # a p95 just over target with one miss in 40 frames is not severe: the cut waits
    assert limit.update(sample(p95=0.9, misses=1, active=30, frames=40)) == 24


def test_aimd_is_the_slow_start_limit():
    assert isinstance(make_limit("aimd"), SlowStartLimit)
    with pytest.raises(ValueError, match="growth"):
        SlowStartLimit(growth=1.0)


def test_an_idle_or_non_binding_cap_returns_to_its_resting_cap():
    limit = SlowStartLimit(initial_cap=4)
    for active in (4, 3):  # a burst of misses cut it (each cut bites: active <= cap)
        limit.update(sample(p95=1.0, misses=10, active=active))
    assert limit.cap == 2
    assert limit.update(IntervalSample([], 0, 0, 0)) == 3  # idle: half the gap to 4
    assert limit.update(sample(p95=0.3, active=1)) == 4  # under target, not binding
    assert limit.update(IntervalSample([], 0, 0, 0)) == 4  # at rest: no higher
    planned = SlowStartLimit(initial_cap=4, resting_cap=200)  # the planner's N*
    assert planned.update(IntervalSample([], 0, 0, 0)) == 102
    assert planned.update(sample(p95=0.9, active=2)) == 91  # over target: cut, not rest


def test_a_steered_interval_over_target_holds_and_under_target_grows():
    over = IntervalSample([0.9] * 10, deadline_misses=3, stalled_frames=0, active_sessions=8,
                          steered=True)
    aimd, slow = AIMDLimit(initial_cap=8), SlowStartLimit(initial_cap=8)
    assert (aimd.update(over), slow.update(over), slow.slow_start) == (8, 8, True)
    under = IntervalSample([0.3] * 10, 0, 0, active_sessions=8, steered=True)
    assert aimd.update(under) == 9 and slow.update(under) > 8


def test_a_listener_that_ran_dry_is_a_miss_even_in_an_interval_with_no_frame():
    """A turn server's signal is mostly its replies: an interval where a reply's listener ran
    dry (and no frame finished) cuts the cap as a late frame would; without it, no signal."""
    limit = AIMDLimit(initial_cap=8)
    assert limit.update(IntervalSample([], 0, 0, 8)) == 8
    assert limit.update(IntervalSample([], 0, 0, 8, output_gaps=1)) == 7  # x0.9
    slow = SlowStartLimit(initial_cap=8)
    assert slow.update(IntervalSample([0.1] * 10, 0, 0, 8, output_gaps=2)) == 7


def test_the_controller_counts_output_gaps_into_its_interval_and_starts_over():
    from metronome.admission.controller import AdmissionController

    controller = AdmissionController(AIMDLimit(initial_cap=8), lambda: 8, interval_s=1.0)
    controller.on_output_gap(0.25)
    controller.on_output_gap(0.5)
    assert controller.end_interval(1.0) == 7
    assert controller.history[-1].output_gaps == 2
    assert controller.end_interval(2.0) == 7  # nothing new: no signal, the cap holds
    assert controller.history[-1].output_gaps == 0


def test_input_the_server_fell_behind_on_is_a_miss_counted_into_its_interval():
    """Real-time audio kept past a session's buffer bound (`serve.realtime.intake`): the
    server is behind its input, a miss as a late frame is, even with no frame finished."""
    from metronome.admission.controller import AdmissionController

    assert AIMDLimit(initial_cap=8).update(IntervalSample([], 0, 0, 8, input_behind=1)) == 7
    controller = AdmissionController(AIMDLimit(initial_cap=8), lambda: 8, interval_s=1.0)
    for _ in range(3):
        controller.on_input_behind()
    assert controller.end_interval(1.0) == 7
    assert controller.history[-1].input_behind == 3
    assert controller.end_interval(2.0) == 7  # nothing new: no signal, the cap holds
    assert controller.history[-1].input_behind == 0
