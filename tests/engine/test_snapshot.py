"""Snapshot and restore of a bounded session (engine.snapshot): a session moved to another
engine mid-conversation continues token-exact; exhaustion is a return value; unbounded
sessions are refused."""

from __future__ import annotations

import pytest

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.engine.snapshot import SessionSnapshot, SnapshotError
from metronome.kv.residency import ResidencyPolicy
from metronome.stream import Stream
from tests.steps import by_session


def make_engine(model, block: int, pool_blocks: int = 64) -> Engine:
    """16-token chunks always (the tests count steps: no larger prefill chunks)."""
    return Engine(model, EngineConfig(block_size=block, pool_tokens=pool_blocks * block,
                                      max_chunk_tokens=16, max_step_tokens=64,
                                      max_prefill_chunk_tokens=16))


def generate(engine: Engine, sid: str, max_steps: int | None = None) -> list[int]:
    tokens, steps = [], 0
    while engine.sessions[sid].has_work and (max_steps is None or steps < max_steps):
        tokens += by_session(engine.step())[sid].new_token_ids
        steps += 1
    return tokens


def rotate_free_blocks(engine: Engine, num_blocks: int) -> None:
    """Use and return some blocks, so the pool's FIFO hands a restore other block ids."""
    block = engine.config.block_size
    sid = engine.open_session(Stream.of())
    engine.submit(sid, [1] * (num_blocks * block))
    generate(engine, sid)
    engine.close(sid)


def check_moved_session_continues_exactly(model, block, policy, prompt, turn):
    source, target = make_engine(model, block), make_engine(model, block)
    rotate_free_blocks(target, 5)
    sid = source.open_session(Stream.of(SessionSpec(policy=policy, stop_token_ids=())))
    source.submit(sid, prompt, max_new_tokens=40)
    before = generate(source, sid, max_steps=-(-len(prompt) // 16) + 19)  # 20 tokens in
    assert source.session_tokens(sid) > policy.sink_tokens + policy.window_tokens + block
    data = source.snapshot_session(sid).to_bytes()
    restored = "moved"
    assert target.restore_session(SessionSnapshot.from_bytes(data), Stream(restored))
    own, moved = source.sessions[sid].table, target.sessions[restored].table
    assert list(moved.logical_to_block_id) == list(own.logical_to_block_id)  # sinks + window
    assert moved.block_ids != own.block_ids  # its own pool's blocks
    assert own.logical_to_block_id and min(own.logical_to_block_id) == 0  # the sink block
    assert len(own.logical_to_block_id) < max(own.logical_to_block_id) + 1  # window slid

    rest = generate(source, sid), generate(target, restored)
    source.submit(sid, turn, max_new_tokens=12)
    target.submit(restored, turn, max_new_tokens=12)
    after = generate(source, sid), generate(target, restored)
    assert len(before) == 20 and len(rest[0]) == 20 and len(after[0]) == 12
    assert rest[0] == rest[1] and after[0] == after[1]
    assert target.session_tokens(restored) == source.session_tokens(sid)
    target.close(restored)
    assert target.pool_stats().used_blocks == 0
    return len(data)


@pytest.mark.parametrize("positions", ["absolute", "rolling"])
def test_tiny_session_moved_mid_generation_continues_token_exact(tiny_model, positions):
    policy = ResidencyPolicy.sinks_window(4, 16, positions)
    prompt = [(7 * i + 3) % 96 for i in range(40)]
    check_moved_session_continues_exactly(tiny_model, 4, policy, prompt, [5, 9, 11, 2])


def test_smollm2_session_moved_mid_generation_continues_token_exact(smollm2):
    policy = ResidencyPolicy.sinks_window(4, 32)
    prompt = [(31 * i + 100) % 5000 + 200 for i in range(96)]  # the reply's horizon: past
    # the sink block too
    nbytes = check_moved_session_continues_exactly(smollm2, 16, policy, prompt,
                                                   [1000, 2000, 3000])
    cfg = smollm2.config
    # the sink block, the window's 3 (96 + 19 = 115 tokens written: from 84, block 5) and
    # one the reply's rewind horizon holds (a query at its start, 96, sees from 65: block 4)
    blocks = 1 + 3 + 1
    kv_bytes = blocks * 16 * cfg.kv_bytes_per_token(smollm2.dtype)
    assert kv_bytes <= nbytes < kv_bytes + 64 * 1024  # KV plus header, generator, input


def test_restore_into_a_pool_too_small_is_refused_as_exhaustion(tiny_model):
    source = make_engine(tiny_model, 4)
    sid = source.open_session(Stream.of(SessionSpec(policy=ResidencyPolicy.sinks_window(4, 16))))
    source.submit(sid, list(range(40)))
    generate(source, sid)
    snapshot = source.snapshot_session(sid)
    small = make_engine(tiny_model, 4, pool_blocks=len(snapshot.logical_blocks) - 1)
    assert not small.restore_session(snapshot, Stream("moved"))
    assert small.sessions == {} and small.pool_stats().used_blocks == 0


def test_unbounded_session_is_not_snapshotted(tiny_model):
    engine = make_engine(tiny_model, 4)
    sid = engine.open_session(Stream.of())
    engine.submit(sid, [1, 2, 3])
    generate(engine, sid)
    with pytest.raises(SnapshotError, match="unbounded"):
        engine.snapshot_session(sid)


def test_snapshot_refused_by_an_engine_of_another_geometry(tiny_model):
    source = make_engine(tiny_model, 4)
    sid = source.open_session(Stream.of(SessionSpec(policy=ResidencyPolicy.window(8))))
    source.submit(sid, list(range(12)))
    generate(source, sid)
    other = make_engine(tiny_model, 8)
    with pytest.raises(SnapshotError, match="block_size=4"):
        other.restore_session(source.snapshot_session(sid), Stream("moved"))
    with pytest.raises(SnapshotError, match="not a Metronome"):
        SessionSnapshot.from_bytes(b"hello")


def test_bytes_round_trip_keeps_every_tensor_bf16_and_pending_embeddings():
    import torch

    from metronome.model.config import TINY_LLAMA
    from metronome.model.weights import random_model

    engine = make_engine(random_model(TINY_LLAMA, torch.bfloat16, seed=2), 4)
    sid = engine.open_session(Stream.of(SessionSpec(policy=ResidencyPolicy.sinks_window(4, 8))))
    engine.submit(sid, list(range(30)), max_new_tokens=3)
    generate(engine, sid)
    engine.submit(sid, embeddings=torch.randn(5, TINY_LLAMA.hidden_size), max_new_tokens=2)
    snapshot = engine.snapshot_session(sid)
    back = SessionSnapshot.from_bytes(bytes(snapshot.to_bytes()))
    assert back.k.dtype == torch.bfloat16 and torch.equal(back.k, snapshot.k)
    assert torch.equal(back.v, snapshot.v)
    assert [c.dtype for c in back.pending] == [torch.bfloat16]  # the input, unread
    assert len(back.carry) == 0 and len(back.feedback) == 1  # the carried token goes first
    assert all(torch.equal(a, b) for a, b in zip(back.pending, snapshot.pending, strict=True))
    # 30 prompt tokens and 2 of the 3 sampled written; the 3rd is carried
    assert back.spec == snapshot.spec and back.num_tokens == 32 and back.decode_budget == 2
    assert torch.equal(back.generator_state, snapshot.generator_state)


def test_snapshot_off_the_engine_thread_is_a_bug(tiny_model):
    import threading

    engine = make_engine(tiny_model, 4)
    sid = engine.open_session(Stream.of(SessionSpec(policy=ResidencyPolicy.window(8))))
    engine.submit(sid, [1, 2, 3])
    generate(engine, sid)  # this thread steps the engine: it is the engine's thread
    errors = []

    def elsewhere() -> None:
        try:
            engine.snapshot_session(sid)
        except AssertionError as err:
            errors.append(str(err))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert errors and "engine's thread" in errors[0]
