"""The beat on the virtual clock: the silent cliff made visible, and the bound that avoids it."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.sampling import SamplingParams
from metronome.kv.residency import ResidencyPolicy
from metronome.observe.stall_detector import Health
from metronome.runtime.observer import RuntimeObserver
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionProfile
from metronome.sim.cost_model import StepCostModel
from metronome.sim.recorder import RunRecorder
from metronome.sim.virtual import VirtualDriver
from metronome.sim.workload import Workload, schedule
from metronome.stream import Frame, FrameStatus, Stream

BLOCK = 16
COST = StepCostModel(fixed_s=0.004, per_token_s=0.0005, per_context_token_s=1e-6)


def text_frames(vocab: int, tokens: int = 12):
    return lambda sid, i: ([(sid * 31 + i * 7 + k) % (vocab - 1) + 1 for k in range(tokens)], None)


class Run:
    """A virtual-clock run of the tiny model with observers, recording forecasts over time."""

    def __init__(self, model, policy: str, pool_blocks: int, sessions=8, duration_s=30.0):
        self.engine = Engine(model, EngineConfig(block_size=BLOCK, pool_tokens=pool_blocks * BLOCK))
        self.recorder = RunRecorder()
        self.observer = RuntimeObserver.create(BLOCK)
        self.forecasts: list[tuple[float, float, float]] = []  # (t, used fraction, predicted t)
        self.driver = VirtualDriver(self.engine, COST, Listeners.of(self.recorder, self.observer,
                                                                   self))
        self.profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=4,
                                      policy=ResidencyPolicy.parse(policy))
        self.workload = Workload(sessions, duration_s, arrival_spread_s=0.0, seed=3)
        schedule(self.workload, self.profile, self.driver.beat, self.driver.clock,
                 text_frames(model.config.vocab_size))
        self.driver.run_until(self.workload.end_s + 3)

    def on_step(self, report):  # after the recorder's and the observer's
        used = report.pool.used_blocks / report.pool.num_blocks
        self.forecasts.append((report.finished_s, used,
                               self.observer.forecaster.predicted_saturation_time_s))


@pytest.fixture(scope="module")
def unbounded_run(tiny_model):
    return Run(tiny_model, "unbounded", pool_blocks=100)


@pytest.fixture(scope="module")
def bounded_run(tiny_model):
    return Run(tiny_model, "sinks_window:4:64", pool_blocks=100)


def test_unbounded_cliff_is_silent_on_standard_metrics_but_not_on_ours(unbounded_run):
    summary = unbounded_run.recorder.summary()
    # frames keep going out on the beat; latency and deadline misses look healthy ...
    assert summary["deadline_met_fraction"] == 1.0
    assert summary["latency_ms"]["p95"] < 1000 * 0.1
    assert summary["frames"] == 8 * 30
    # ... while goodput collapses, stalled_kv frames rise and the detector says so
    assert summary["goodput"] < 0.6
    assert summary["frames_by_status"]["stalled_kv"] > 0.4 * summary["frames"]
    assert unbounded_run.observer.detector.state is Health.CRITICAL
    assert "stalled" in unbounded_run.observer.detector.reason


def test_forecast_before_saturation_is_within_ten_percent(unbounded_run):
    stalls = [r.finish_s for r in unbounded_run.recorder.results
              if r.status is FrameStatus.STALLED_KV]
    saturated_at_s = min(stalls)
    before = [(t, used, pred) for t, used, pred in unbounded_run.forecasts
              if used >= 0.5 and t < saturated_at_s and math.isfinite(pred)]
    assert before, "no forecast was made between half-full and saturation"
    t, _, predicted_s = before[0]
    assert abs(predicted_s - saturated_at_s) <= 0.1 * saturated_at_s, (t, predicted_s,
                                                                       saturated_at_s)


def test_bounded_run_never_stalls_and_forecast_reads_never(bounded_run):
    summary = bounded_run.recorder.summary()
    assert summary["frames_by_status"]["stalled_kv"] == 0
    assert summary["goodput"] >= 0.99
    assert bounded_run.observer.detector.state is Health.OK
    steady = [pred for t, _, pred in bounded_run.forecasts if 20 <= t <= 30]
    assert steady and all(math.isinf(p) for p in steady)
    assert bounded_run.engine.pool_stats().used_blocks == 0  # every session closed


def test_metrics_endpoint_text_parses_and_has_every_metric(unbounded_run):
    text = unbounded_run.observer.metrics.render().decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    for expected in ["metronome_frame_latency_seconds", "metronome_frames",
                     "metronome_frame_tokens", "metronome_kv_pool_blocks",
                     "metronome_kv_pool_saturation_eta_seconds", "metronome_sessions_active",
                     "metronome_engine_step_seconds", "metronome_step_batch_frames",
                     "metronome_goodput_ratio"]:
        assert expected in names, (expected, sorted(names))
    assert 'metronome_frames_total{status="stalled_kv"}' in text


def test_bad_frame_and_disconnect_touch_no_other_session(tiny_model):
    engine = Engine(tiny_model, EngineConfig(block_size=BLOCK, pool_tokens=64 * BLOCK))
    recorder = RunRecorder()
    driver = VirtualDriver(engine, COST, Listeners.of(recorder))
    beat = driver.beat
    profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=3,
                             policy=ResidencyPolicy.sinks_window(4, 32))
    good, bad, leaver = "good", "bad", "leaver"
    streams = {sid: Stream(sid, profile) for sid in (good, bad, leaver)}
    for stream in streams.values():
        beat.add(stream)
    vocab = tiny_model.config.vocab_size
    for i in range(6):
        t = float(i + 1)
        driver.run_until(t)
        beat.submit(Frame(good, t), t, [1, 2, 3, 4])
        beat.submit(Frame(bad, t), t, [] if i % 2 else [vocab + 5])
        if i < 3:
            beat.submit(Frame(leaver, t), t, [5, 6, 7])
        if i == 2:
            driver.run_until(t + 0.001)  # mid-frame: its work is in flight
            beat.close(streams[leaver], t + 0.001)
            assert leaver not in engine.sessions  # blocks returned at once
    driver.run_until(10.0)
    by_session = {}
    for r in recorder.results:
        by_session.setdefault(r.session_id, []).append(r)
    assert [r.status for r in by_session[good]] == [FrameStatus.OK] * 6
    assert all(len(r.token_ids) == 3 and r.deadline_met for r in by_session[good])
    assert {r.status for r in by_session[bad]} == {FrameStatus.REJECTED}
    assert len(by_session[bad]) == 6
    assert [r.status for r in by_session[leaver]][-1] is FrameStatus.CANCELLED


def test_late_frames_keep_their_tokens_and_the_next_frame_starts_clean(tiny_model):
    """Steps of 0.3 s: a frame's 4th token is sampled by a step that straddles its deadline.
    That token is the late frame's (late_token_ids), never the next frame's."""
    engine = Engine(tiny_model, EngineConfig(block_size=BLOCK, pool_tokens=64 * BLOCK))
    recorder = RunRecorder()
    late_counts = []
    driver = VirtualDriver(engine, StepCostModel(0.3, 0.0, 0.0),
                           Listeners(on_result=recorder.on_result,
                                     on_late_tokens=late_counts.append))
    profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=4,
                             policy=ResidencyPolicy.sinks_window(4, 64),
                             sampling=SamplingParams())
    driver.beat.add(Stream("s", profile))
    for i in range(5):
        t = float(i + 1)
        driver.clock.call_at(t, lambda now, i=i: driver.beat.submit(
            Frame("s", now), now, [1 + i, 2, 3]))
    driver.run_until(8.0)
    frames = sorted(recorder.results, key=lambda r: r.index)
    assert [r.status for r in frames] == [FrameStatus.LATE] * 5
    for r in frames:
        assert r.start_s is None or r.start_s >= r.arrival_s  # no work credited before arrival
        assert len(r.token_ids) + len(r.late_token_ids) <= 4
    assert any(r.late_token_ids for r in frames) and sum(late_counts) == sum(
        len(r.late_token_ids) for r in frames)


def test_an_engine_stalled_everywhere_steps_again_only_after_a_command(tiny_model):
    """The idle rule (runtime.driver): after a step in which nobody processed input, the
    driver waits for the next engine command instead of re-stepping every step time."""
    engine = Engine(tiny_model, EngineConfig(block_size=BLOCK, pool_tokens=2 * BLOCK))
    recorder = RunRecorder()
    driver = VirtualDriver(engine, StepCostModel(0.01, 0.0, 0.0), Listeners.of(recorder))
    profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=0,
                             policy=ResidencyPolicy.unbounded())
    hog, starved = Stream("hog", profile), Stream("starved", profile)
    driver.beat.add(hog)
    driver.beat.add(starved)
    driver.beat.submit(Frame("hog", 0.0), 0.0, list(range(1, 2 * BLOCK + 1)))
    driver.run_until(0.5)  # the hog holds the whole pool
    driver.beat.submit(Frame("starved", 0.5), 0.5, [1, 2, 3])
    driver.run_until(5.0)  # 4.5 s of a stalled engine: 0.01 s steps would be 450 of them
    stalled_steps = [s for s in recorder.steps if s.finished_s > 0.5]
    assert 1 <= len(stalled_steps) <= 3, len(stalled_steps)
    assert [r.status for r in recorder.results if r.session_id == "starved"] == [
        FrameStatus.STALLED_KV]
    driver.beat.close(hog, 5.0)  # a command: the starved session's input runs now
    driver.run_until(6.0)
    assert engine.resident_tokens("starved") == 3
