"""Stall detector: flags frames that go out on time but empty, and recovers when they stop."""

from __future__ import annotations

import pytest

from metronome.observe.stall_detector import Health, StallDetector


def feed(detector: StallDetector, num_frames: int, status: str, num_tokens: int,
         deadline_met: bool = True, expected_output: bool = True) -> None:
    for _ in range(num_frames):
        detector.observe(status, num_tokens, expected_output, deadline_met)


def test_silent_stall_on_time_is_degraded_then_critical():
    detector = StallDetector(window_frames=200)
    feed(detector, 190, "ok", 3)
    feed(detector, 10, "stalled_kv", 0)  # every frame met its deadline
    assert detector.state is Health.DEGRADED
    assert detector.reason == (
        "5% of the last 200 frames stalled on KV while 100% of them met their deadline:"
        " silent stall"
    )
    feed(detector, 74, "stalled_kv", 0)
    assert detector.stalled_fraction == 84 / 200
    assert detector.state is Health.DEGRADED
    feed(detector, 16, "stalled_kv", 0)
    assert detector.state is Health.CRITICAL
    assert detector.reason.startswith("50% of the last 200 frames stalled on KV")


def test_empty_ok_frames_count_when_output_was_expected():
    # The baseline engine may not say why; an empty frame where output was due is a stall.
    detector = StallDetector(window_frames=100)
    feed(detector, 90, "ok", 2)
    feed(detector, 10, "ok", 0)
    assert detector.state is Health.DEGRADED
    feed(detector, 100, "ok", 0, expected_output=False)  # listening frames: nothing is due
    assert detector.state is Health.OK
    assert detector.reason == "0% of the last 100 frames stalled on KV"


def test_visible_stall_is_labelled_visible():
    detector = StallDetector(window_frames=20, min_frames=20)
    feed(detector, 15, "ok", 1)
    feed(detector, 4, "stalled_kv", 0, deadline_met=False)
    feed(detector, 1, "stalled_kv", 0)
    assert detector.state is Health.DEGRADED
    assert detector.reason == (
        "25% of the last 20 frames stalled on KV while 20% of them met their deadline:"
        " visible stall"
    )


def test_recovers_when_the_window_is_clean_again():
    detector = StallDetector(window_frames=50)
    feed(detector, 50, "stalled_kv", 0)
    assert detector.state is Health.CRITICAL
    feed(detector, 48, "ok", 1)  # 2 stalled left of 50: 4 %
    assert detector.state is Health.OK
    feed(detector, 2, "ok", 1)
    assert detector.stalled_fraction == 0.0


def test_no_verdict_before_min_frames():
    detector = StallDetector(min_frames=20)
    feed(detector, 19, "stalled_kv", 0)
    assert detector.state is Health.OK
    assert detector.reason == "19 frames observed, fewer than the 20 needed"
    feed(detector, 1, "stalled_kv", 0)
    assert detector.state is Health.CRITICAL


def test_rejects_inconsistent_thresholds():
    with pytest.raises(ValueError):
        StallDetector(degraded_stalled_fraction=0.6, critical_stalled_fraction=0.5)
    with pytest.raises(ValueError):
        StallDetector(window_frames=10, min_frames=20)
