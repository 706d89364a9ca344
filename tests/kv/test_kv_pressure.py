"""Graceful degradation at the KV wall (opt-in): under pressure the engine bounds unbounded
sessions to the pressure policy, largest first, so no session is stuck while all stay open;
without it, sessions that hit the wall get nothing for the rest of the run."""

from __future__ import annotations

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.engine.types import WorkStatus
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionProfile
from metronome.sim.cost_model import StepCostModel
from metronome.sim.recorder import RunRecorder
from metronome.sim.virtual import VirtualDriver
from metronome.stream import Frame, Stream
from tests.owner import RecordingOwner
from tests.steps import by_session

BLOCK = 4
BOUND = ResidencyPolicy.sinks_window(2, 8)
COST = StepCostModel(fixed_s=0.004, per_token_s=0.0005, per_context_token_s=1e-6)


def test_pressure_bounds_the_largest_unbounded_session_first(tiny_model):
    engine = Engine(tiny_model, EngineConfig(block_size=BLOCK, pool_tokens=12 * BLOCK,
                                             max_chunk_tokens=8, pressure_policy=BOUND))
    big, small = engine.open_session(Stream.of()), engine.open_session(Stream.of())
    engine.submit(big, list(range(1, 33)))  # 8 blocks, in chunks of 8 tokens
    engine.submit(small, [1, 2, 3, 4, 5, 6, 7, 8])  # 2 blocks
    while engine.has_work:
        assert not engine.step().rebounds
    assert engine.pool_stats().free_blocks == 2
    engine.submit(small, list(range(1, 13)))  # needs 2 blocks, then 1 more: pool is dry
    first = engine.step()
    assert first.rebounds == [] and by_session(first)[small].status is WorkStatus.OK
    second = engine.step()
    assert [(r.session_id, r.policy, r.freed_blocks) for r in second.rebounds] == [
        (big, BOUND, 5)]  # blocks 1..5 of 0..7: sinks (block 0) and the window (6, 7) stay
    assert by_session(second)[small].status is WorkStatus.OK
    assert engine.sessions[big].spec.policy == BOUND
    assert engine.resident_tokens(big) <= BOUND.max_resident_tokens(BLOCK)
    assert not engine.sessions[small].spec.policy.bounded  # it was not needed


def test_without_pressure_policy_the_pool_stalls_and_nothing_is_rebound(tiny_model):
    engine = Engine(tiny_model, EngineConfig(block_size=BLOCK, pool_tokens=4 * BLOCK))
    sid = engine.open_session(Stream.of(SessionSpec()))
    engine.submit(sid, list(range(1, 21)))
    statuses = [by_session(engine.step())[sid].status for _ in range(3)]
    assert WorkStatus.STALLED_KV in statuses and engine.sessions[sid].has_work


def wall_run(model, pressure_policy, sessions=8, duration_s=40.0):
    """Unbounded sessions (12 tokens in, 4 out per 1 s frame) in a pool that holds ~13 s of
    all of them: the wall comes at ~13 s and every session stays open to the end."""
    engine = Engine(model, EngineConfig(block_size=16, pool_tokens=100 * 16,
                                        pressure_policy=pressure_policy))
    recorder, rebounds = RunRecorder(), []
    driver = VirtualDriver(engine, COST, Listeners.of(recorder, Listeners(
        on_rebound=rebounds.append)))
    profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=4,
                             policy=ResidencyPolicy.unbounded())
    owner = RecordingOwner()
    sids = [f"s{n}" for n in range(sessions)]
    for sid in sids:
        driver.beat.add(Stream(sid, profile, owner=owner))
    vocab = model.config.vocab_size
    for i in range(int(duration_s)):
        for n, sid in enumerate(sids):
            driver.clock.call_at(i + 1.0, lambda t, sid=sid, n=n, i=i: driver.beat.submit(
                Frame(sid, t), t, [(n * 31 + i * 7 + k) % (vocab - 1) + 1 for k in range(12)]))
    driver.run_until(duration_s + 1)
    told = [r.session_id for r in owner.rebounds]  # what each stream's owner was told
    return recorder.results, rebounds, told, sids


def longest_bad_run(results, sid) -> int:
    run = longest = 0
    for r in sorted((r for r in results if r.session_id == sid), key=lambda r: r.index):
        run = 0 if r.good else run + 1
        longest = max(longest, run)
    return longest


def test_the_wall_becomes_graceful_degradation(tiny_model):
    stuck, _, _, sids = wall_run(tiny_model, pressure_policy=None)
    wall_s = min(r.finish_s for r in stuck if r.status.value == "stalled_kv")
    after = [r for r in stuck if r.arrival_s > wall_s]
    stuck_goodput = sum(r.good for r in after) / len(after)
    assert 10 < wall_s < 16 and stuck_goodput < 0.2
    assert max(longest_bad_run(stuck, sid) for sid in sids) > 20  # stuck to the end

    graceful, rebounds, told, sids = wall_run(tiny_model, pressure_policy=ResidencyPolicy
                                              .sinks_window(4, 64))
    after = [r for r in graceful if r.arrival_s > wall_s]
    graceful_goodput = sum(r.good for r in after) / len(after)
    print(f"goodput after the wall at {wall_s:.1f} s: {stuck_goodput:.3f} stuck, "
          f"{graceful_goodput:.3f} with degrade_policy ({len(rebounds)} sessions bound)")
    assert graceful_goodput >= 0.95
    assert max(longest_bad_run(graceful, sid) for sid in sids) <= 2  # nobody is stuck
    assert sorted(told) == sorted(r.session_id for r in rebounds)  # each owner was told
    assert len(set(told)) == len(told) >= len(sids) // 2  # bounded once, only as needed
    assert all(r.freed_blocks > 0 for r in rebounds)
