"""One session's limits: its queued input is bounded (refused, never dropped), its own
oversized input cannot cut the admission cap, and the KV pool sets a memory ceiling on how
many sessions are admitted (a pool too small for one session is refused at start)."""

from __future__ import annotations

import pytest

from metronome.admission.controller import AdmissionController
from metronome.admission.limits import AIMDLimit
from metronome.engine.engine import Engine, EngineConfig, blocks_per_session, memory_ceiling
from metronome.kv.block_pool import BlockPool
from metronome.kv.block_table import BlockTable
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionProfile
from metronome.serve.config import ServerConfig
from metronome.sim.cost_model import StepCostModel
from metronome.sim.recorder import RunRecorder
from metronome.sim.virtual import VirtualDriver
from metronome.stream import Frame, FrameStatus, Stream

BLOCK = 16
SLOW = StepCostModel(fixed_s=0.05, per_token_s=0.001, per_context_token_s=0.0)


def flood_run(model, limit: int | None, frame_tokens: int, frames: int, others: int = 0,
              controller: AdmissionController | None = None):
    """One session sends `frame_tokens` of input every second (far more than it can
    process); `others` sessions send 12 tokens a second. Returns what was seen."""
    engine = Engine(model, EngineConfig(block_size=BLOCK, pool_tokens=256 * BLOCK))
    recorder = RunRecorder()
    listeners = Listeners.of(recorder) if controller is None else Listeners.of(recorder,
                                                                             controller)
    driver = VirtualDriver(engine, SLOW, listeners)
    profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=2,
                             policy=ResidencyPolicy.sinks_window(4, 64),
                             max_queued_input_tokens=limit)
    beat = driver.beat
    flood, calm = "flood", [f"calm-{k}" for k in range(others)]
    for sid in [flood, *calm]:
        beat.add(Stream(sid, profile))
    if controller is not None:
        controller.start(driver.clock)
    peak_queued = 0
    for i in range(frames):
        t = float(i + 1)
        driver.run_until(t)
        beat.submit(Frame(flood, t), t, [1 + (i + k) % 90 for k in range(frame_tokens)])
        for sid in calm:
            beat.submit(Frame(sid, t), t, [5 + k for k in range(12)])
        peak_queued = max(peak_queued, beat.streams[flood].queued_input_tokens)
    return engine, driver, recorder, flood, peak_queued


def test_queued_input_is_bounded_refused_with_the_numbers_and_never_dropped(tiny_model):
    engine, driver, recorder, flood, peak = flood_run(tiny_model, limit=1500,
                                                      frame_tokens=1000, frames=12)
    assert peak <= 1500
    mine = [r for r in recorder.results if r.session_id == flood]
    rejected = [r for r in mine if r.status is FrameStatus.REJECTED]
    accepted = [r for r in mine if r.status is not FrameStatus.REJECTED]
    assert rejected and accepted
    assert rejected[0].reason.startswith("input queue full: ")
    assert "this frame adds 1000; the limit is 1500" in rejected[0].reason
    driver.run_until(200.0)  # let the engine catch up: every accepted token is processed
    assert driver.beat.streams[flood].queued_input_tokens == 0
    written = engine.session_tokens(flood)
    assert written >= 1000 * len(accepted)  # accepted input + fed-back sampled tokens
    assert written <= 1000 * len(accepted) + 2 * len(accepted)


def test_without_a_bound_the_backlog_grows_without_limit(tiny_model):
    _, _, _, _, peak = flood_run(tiny_model, limit=None, frame_tokens=2000, frames=12)
    assert peak > 8000  # 2000 tokens/s in, ~840/s out (alone: 256 per 0.306 s step)


def test_one_sessions_own_flood_does_not_cut_the_cap(tiny_model):
    def run(self_paced_tokens):
        controller = AdmissionController(AIMDLimit(initial_cap=4), lambda: 2,
                                         self_paced_tokens=self_paced_tokens)
        flood_run(tiny_model, limit=None, frame_tokens=600, frames=20, others=1,
                  controller=controller)
        return controller

    judged = run(self_paced_tokens=64)
    assert [s.cap for s in judged.history][-1] == 4  # the calm session met its deadlines
    assert sum(s.self_paced for s in judged.history) >= 15
    assert judged.try_admit(20.0).admitted
    blind = run(self_paced_tokens=None)  # every late frame of the flood counts
    assert min(s.cap for s in blind.history) < 4


def test_blocks_per_session_is_the_peak_a_table_reaches():
    for policy, chunk in [(ResidencyPolicy.sinks_window(4, 512), 64),
                          (ResidencyPolicy.sinks_window(2, 6), 4),
                          (ResidencyPolicy.window(8), 3)]:
        pool, table = BlockPool(100), BlockTable(policy, BLOCK if chunk == 64 else 4)
        table.append(1, pool)  # chunks that start mid-block reach the peak
        peak = 0
        for _ in range(200):
            table.append(chunk, pool)
            peak = max(peak, len(table.logical_to_block_id))
            table.slide(pool)
        assert peak == policy.max_blocks(table.block_size, chunk), (policy, chunk)
    config = EngineConfig(block_size=16, max_chunk_tokens=64)
    assert blocks_per_session(ResidencyPolicy.sinks_window(4, 512), config) == 38
    assert ResidencyPolicy.sinks_window(4, 512).max_blocks(16) == 34
    assert memory_ceiling(ResidencyPolicy.sinks_window(4, 512), config, 4096) == 107
    assert memory_ceiling(ResidencyPolicy.unbounded(), config, 4096) is None


def test_a_pool_too_small_for_one_session_is_refused_at_start():
    with pytest.raises(ValueError, match=r"a KV pool of 16 blocks of 16 tokens \(256 tokens\) "
                       r"cannot hold one sinks_window:4:512@absolute session: it needs 54 "
                       r"blocks \(34 for its sinks and window, 20 more while a 64-token chunk "
                       r"is written after a 256-token reply held for a rewind\)"):
        ServerConfig(pool_tokens=256)
    assert ServerConfig(pool_tokens=864).pool_tokens == 864  # exactly one session's peak
    with pytest.raises(ValueError, match="it needs 54 blocks"):
        ServerConfig(pool_tokens=848)
    assert ServerConfig(pool_tokens=624, max_response_tokens=16).pool_tokens == 624  # 39
    ServerConfig(pool_tokens=256, policy="unbounded")  # no bound, no per-session size


def test_admission_never_passes_the_memory_ceiling():
    active = [0]
    controller = AdmissionController(AIMDLimit(initial_cap=10), lambda: active[0],
                                     memory_ceiling=3)
    decisions = []
    for _ in range(5):
        decision = controller.try_admit(0.0)
        decisions.append(decision.reason or "admitted")
        active[0] += decision.admitted
    assert decisions == ["admitted"] * 3 + ["kv_memory"] * 2
    assert controller.effective_cap == 3 and controller.counts["refused:kv_memory"] == 2
