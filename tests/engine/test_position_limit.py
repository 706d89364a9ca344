"""A bounded session never ends at the model's position limit: with sinks under absolute
positions, the step that would take it past the trained range rolls it (rolling positions,
reported as a `Rebound` with reason "position_limit"), and from then on it computes exactly
what a session under the rolling policy computes over the same KV."""

from __future__ import annotations

import dataclasses

import torch

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.engine.snapshot import SessionSnapshot
from metronome.engine.types import WorkStatus
from metronome.kv.residency import Positions, ResidencyPolicy
from metronome.stream import Stream
from tests.steps import by_session

LIMIT = 96


def make_engine(model) -> Engine:
    return Engine(model, EngineConfig(block_size=4, pool_tokens=256, max_chunk_tokens=8,
                                      max_step_tokens=64, max_prefill_chunk_tokens=8,
                                      position_limit_tokens=LIMIT))


def run(engine: Engine, sid: str) -> list:
    outs = []
    while engine.sessions[sid].has_work:
        outs.append(engine.step())
    return outs


def test_a_bounded_session_rolls_at_the_position_limit_and_goes_on(tiny_model):
    engine = make_engine(tiny_model)
    policy = ResidencyPolicy.sinks_window(4, 16)
    sid = engine.open_session(Stream.of(SessionSpec(policy=policy, stop_token_ids=(),
                                                    return_logits=True)))
    engine.submit(sid, [(5 * i + 1) % 90 for i in range(LIMIT)])  # up to the limit
    before = run(engine, sid)
    assert all(not out.rebounds for out in before)
    assert engine.session_tokens(sid) == LIMIT

    # the same session, moved as it stands into an engine that serves it rolling already
    twin_engine = make_engine(tiny_model)
    snapshot = engine.snapshot_session(sid)
    rolling = dataclasses.replace(policy, positions=Positions.ROLLING)
    twin_snapshot = dataclasses.replace(
        SessionSnapshot.from_bytes(snapshot.to_bytes()),
        spec=dataclasses.replace(snapshot.spec, policy=rolling))
    assert twin_engine.restore_session(twin_snapshot, Stream("twin"))

    turn = [(3 * i + 2) % 90 for i in range(3 * LIMIT)]  # three limits' worth more
    engine.submit(sid, turn, max_new_tokens=4)
    twin_engine.submit("twin", turn, max_new_tokens=4)
    after, twin_after = run(engine, sid), run(twin_engine, "twin")
    rebounds = [r for out in after for r in out.rebounds]
    assert [(r.session_id, r.reason, r.policy) for r in rebounds] == [
        (sid, "position_limit", rolling)]
    assert all(by_session(out)[sid].status is WorkStatus.OK for out in after)
    assert engine.sessions[sid].spec.policy == rolling
    assert engine.session_tokens(sid) == LIMIT + 3 * LIMIT + 3  # the last token carried
    # the first step past the limit rolled; from then on the same chunks of the same input
    # over the same KV as the session served rolling: bit for bit equal
    assert after[0].rebounds
    assert all(torch.equal(out.logits[sid], twin.logits["twin"])
               for out, twin in zip(after, twin_after, strict=True))
    assert [t for o in after for t in o.new_token_ids[sid]] == [
        t for o in twin_after for t in o.new_token_ids["twin"]]
    assert engine.pool_stats().used_blocks <= policy.max_blocks(4, 8)


def test_an_unbounded_or_window_only_session_is_left_as_it_is(tiny_model):
    engine = make_engine(tiny_model)
    for policy in (ResidencyPolicy.window(16), ResidencyPolicy.sinks_window(4, 16, "rolling")):
        sid = engine.open_session(Stream.of(SessionSpec(policy=policy, stop_token_ids=())))
        engine.submit(sid, [7] * (2 * LIMIT))
        assert not [r for out in run(engine, sid) for r in out.rebounds]
        assert engine.sessions[sid].spec.policy == policy
        engine.close(sid)


def test_a_policy_with_a_step_reads_back_from_its_text():
    policy = ResidencyPolicy.sinks_window(40, 417, "rolling", slide_tokens=96)
    assert str(policy) == "sinks_window:40:417/96@rolling"
    assert ResidencyPolicy.parse(str(policy)) == policy
    assert ResidencyPolicy.parse("window:64/32") == ResidencyPolicy(
        ResidencyPolicy.window(64).kind, 0, 64, Positions.ABSOLUTE, 32)
    # between W and W + D - 1 window keys; the window's blocks leave D / block at a time
    assert policy.max_resident_tokens(16) == 40 + 417 + 96 - 1
    assert {policy.window_start(p, 16) % 96 for p in range(500, 900)} == {0}
