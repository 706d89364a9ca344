"""Health says, within one control interval, each of: silent KV stall, overload (deadline
misses), recovered; and nothing but a KV stall is called one."""

from __future__ import annotations

from metronome.engine.engine import Engine, EngineConfig
from metronome.kv.residency import ResidencyPolicy
from metronome.observe.deadline_monitor import DeadlineMonitor
from metronome.observe.stall_detector import Health, StallDetector
from metronome.runtime.observer import RuntimeObserver
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionProfile
from metronome.sim.cost_model import StepCostModel
from metronome.sim.virtual import VirtualDriver
from metronome.stream import Frame, Stream

INTERVAL_S = 2.0


def timed_detector() -> StallDetector:
    return StallDetector(window_frames=1 << 16, min_frames=1, window_s=INTERVAL_S)


def test_late_cancelled_and_rejected_frames_are_not_kv_stalls():
    detector = StallDetector(window_frames=100)
    for status in ("late", "cancelled", "rejected", "context_full"):
        for _ in range(50):
            detector.observe(status, 0, True, False)
    assert detector.stalled_fraction == 0.0 and detector.state is Health.OK
    assert detector.reason == "0% of the last 50 frames stalled on KV"  # the late ones


def test_stall_verdict_decays_with_time_even_without_new_frames():
    detector = timed_detector()
    for i in range(40):
        detector.observe("stalled_kv", 0, True, True, at_s=10 + i * 0.02, session_id=i % 4)
    assert detector.state is Health.CRITICAL
    assert detector.reason.startswith("100% of the 40 frames of the last 2 s stalled on KV "
                                      "while 100% of them met their deadline: silent stall")
    detector.advance(12.79)  # the last stall finished at 10.78: 2.01 s ago
    assert detector.state is Health.OK
    assert detector.reason == ("0 frames observed, fewer than the 1 needed (recovered: the "
                               "last stall was 2.0 s ago)")


def test_one_session_fully_stalled_beside_a_healthy_one_is_degraded():
    detector = StallDetector(window_frames=200)
    for i in range(60):  # the session holding the pool streams happily
        detector.observe("ok", 3, True, True, at_s=i * 0.1, session_id="holder")
    for i in range(3):  # its neighbour gets nothing: 3 of 63 frames, under 5 %
        detector.observe("stalled_kv", 0, True, True, at_s=i, session_id="starved")
    assert detector.stalled_fraction < detector.degraded_stalled_fraction
    assert detector.state is Health.DEGRADED
    assert detector.reason.endswith("; every frame stalled for session(s) starved (3 frames)")


def test_deadline_misses_read_as_overload_and_self_paced_frames_do_not():
    monitor = DeadlineMonitor(window_frames=1 << 16, min_frames=1, window_s=INTERVAL_S,
                              self_paced_tokens=64)
    for i in range(50):
        monitor.observe("late" if i else "ok", i == 0, own_work_tokens=12, at_s=i * 0.02,
                        session_id=i % 16)
    assert monitor.state is Health.CRITICAL
    assert monitor.reason == ("98% of the 50 frames of the last 2 s missed their deadline: "
                              "overload")
    monitor.advance(5.0)
    assert monitor.state is Health.OK
    for i in range(50):  # a client flooding its own session: its frames are no load signal
        monitor.observe("late", False, own_work_tokens=24_576, at_s=5 + i * 0.02)
    monitor.observe("ok", True, own_work_tokens=12, at_s=6.0)
    assert monitor.state is Health.OK and monitor.num_self_paced == 50


def test_misses_in_a_steered_interval_read_as_the_floods_not_overload():
    """The admission controller judged the last interval steered (self-paced sessions did the
    engine's work out of proportion): the others' misses are named as the floods' doing."""
    monitor = DeadlineMonitor(window_frames=1 << 16, min_frames=1, window_s=INTERVAL_S)
    steered = [False]
    monitor.steered = lambda: steered[0]
    for i in range(50):
        monitor.observe("late", False, at_s=i * 0.02, session_id=i % 4)
    assert monitor.reason.endswith(": overload")
    steered[0] = True
    assert monitor.state is Health.CRITICAL  # the misses are real; the verdict stays
    assert monitor.reason.endswith(": sessions that flood their own input do most of the "
                                   "engine's work (admission holds the cap)")


def run_overload_then_idle(model):
    """16 bounded sessions whose steps take longer than their frames: nearly every frame is
    late. They all close at t = 20 s; health is read every 0.5 s, as /healthz would be."""
    engine = Engine(model, EngineConfig(block_size=16, pool_tokens=1024 * 16))
    observer = RuntimeObserver.create(16, health_window_s=INTERVAL_S, self_paced_tokens=64)
    slow = StepCostModel(fixed_s=0.4, per_token_s=0.0, per_context_token_s=0.0)
    driver = VirtualDriver(engine, slow, Listeners.of(observer))
    profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=4,
                             policy=ResidencyPolicy.sinks_window(4, 64))
    streams = [Stream(f"s{n}", profile) for n in range(16)]
    for stream in streams:
        driver.beat.add(stream)
    for i in range(20):
        for n, stream in enumerate(streams):
            driver.clock.call_at(i + 1.0, lambda t, sid=stream.id, n=n: driver.beat.submit(
                Frame(sid, t), t, [1 + n, 2, 3]))
    driver.clock.call_at(20.5, lambda t: [driver.beat.close(s, t) for s in streams])
    readings = []
    for k in range(1, 61):
        driver.run_until(k * 0.5)
        readings.append((k * 0.5, observer.health_summary(k * 0.5)))
    return readings


def test_overload_shows_within_one_interval_and_recovery_too(tiny_model):
    readings = run_overload_then_idle(tiny_model)
    first_miss = next(t for t, h in readings if h["overload"]["missed_fraction"] > 0)
    critical = next(t for t, h in readings if h["state"] == "critical")
    assert critical - first_miss <= INTERVAL_S, (first_miss, critical)
    during = [h for t, h in readings if 6 <= t <= 20]
    assert all(h["state"] == "critical" and h["reason"].endswith(": overload")
               for h in during)
    assert all(h["kv_stall"]["state"] == "ok" for h in during)  # late is not a KV stall
    recovered = next(t for t, h in readings if t > 20.5 and h["state"] == "ok")
    assert recovered - 20.5 <= INTERVAL_S + 0.5
    assert readings[-1][1]["state"] == "ok"


def test_the_forecast_forgets_sessions_that_closed_without_waiting_for_a_step():
    from metronome.engine.types import PoolStats, StepOutput

    observer = RuntimeObserver.create(16)
    for t in range(6):  # one session growing a block a second in a 100-block pool
        pool = PoolStats(100, 16, used_blocks=t + 1, free_blocks=99 - t, pinned_blocks=0)
        observer.on_step(StepOutput(started_s=t, finished_s=t + 0.01, pool=pool,
                                    resident_tokens={"s7": 16 * (t + 1)}))
    assert observer.eta_s < 200
    idle = PoolStats(100, 16, used_blocks=0, free_blocks=100, pinned_blocks=0)
    observer.observe_pool(6.0, idle, {}, force=True)  # the session closed; no more steps
    assert observer.eta_s == float("inf")
    assert observer.health_summary(6.0)["forecast"]["num_growing_sessions"] == 0
