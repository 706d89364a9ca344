"""A step of long prefills only takes larger chunks (`engine.chunking`): the same logits and
tokens as fixed chunks, never while a session decodes, and never with blocks a bounded
session admitted under the memory ceiling may need."""

from __future__ import annotations

import pytest
import torch

from metronome.engine.engine import Engine, EngineConfig, WorkStatus
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.stream import Stream
from tests.steps import by_session

BLOCK = 4
CHUNK = 8
PREFILL_CHUNK = 32
BOUND = ResidencyPolicy.sinks_window(2, 8)


def make_engine(model, prefill_chunk_tokens: int = PREFILL_CHUNK, pool_blocks: int = 256,
                **config) -> Engine:
    return Engine(model, EngineConfig(block_size=BLOCK, pool_tokens=pool_blocks * BLOCK,
                                      max_chunk_tokens=CHUNK, max_step_tokens=64,
                                      max_prefill_chunk_tokens=prefill_chunk_tokens, **config))


def prompt(k: int, length: int = 100) -> list[int]:
    return [(7 * i + 13 * k + 3) % 96 for i in range(length)]


def run(engine: Engine, sids: list[int]) -> list[dict[int, object]]:
    steps = []
    while engine.has_work:
        steps.append(by_session(engine.step()))
    return steps


@pytest.mark.parametrize("policy", [ResidencyPolicy.unbounded(), BOUND])
@pytest.mark.parametrize("attention", ["auto", "dense"])
def test_long_prefills_take_larger_chunks_and_compute_the_same(tiny_model, policy, attention):
    def logits_and_tokens(prefill_chunk_tokens):
        engine = make_engine(tiny_model, prefill_chunk_tokens, attention=attention)
        sids = [engine.open_session(Stream(f"s{k}", spec=SessionSpec(
            policy=policy, return_logits=True, stop_token_ids=()))) for k in range(2)]
        for k, sid in enumerate(sids):
            engine.submit(sid, prompt(k), max_new_tokens=4)
        steps = run(engine, sids)
        rows = {sid: torch.cat([s[sid].logits for s in steps if sid in s
                                and s[sid].logits is not None]) for sid in sids}
        tokens = {sid: [t for s in steps if sid in s for t in s[sid].new_token_ids]
                  for sid in sids}
        return steps, rows, tokens

    steps, rows, tokens = logits_and_tokens(PREFILL_CHUNK)
    fixed_steps, fixed_rows, fixed_tokens = logits_and_tokens(CHUNK)
    assert [o.input_tokens for o in steps[0].values()] == [PREFILL_CHUNK] * 2
    assert len(steps) < len(fixed_steps)
    assert tokens == fixed_tokens and all(len(t) == 4 for t in tokens.values())
    for sid in rows:
        torch.testing.assert_close(rows[sid], fixed_rows[sid], rtol=1e-4, atol=1e-4)


def test_a_step_with_a_session_decoding_keeps_its_chunks_short(tiny_model):
    engine = make_engine(tiny_model)
    decoding = engine.open_session(Stream.of(SessionSpec(stop_token_ids=())))
    engine.submit(decoding, [5, 6], max_new_tokens=20)
    engine.step()  # its input is in: from now on it decodes, one token a step
    prefilling = engine.open_session(Stream.of(SessionSpec(stop_token_ids=())))
    engine.submit(prefilling, prompt(0))
    for _ in range(5):
        step = by_session(engine.step())
        assert step[decoding].input_tokens == 1
        assert step[prefilling].input_tokens == CHUNK
    engine.close(decoding)
    assert by_session(engine.step())[prefilling].input_tokens == PREFILL_CHUNK  # alone now


def test_larger_chunks_leave_every_bounded_session_the_blocks_of_its_peak(tiny_model):
    """A pool of exactly the memory ceiling's sessions: larger chunks would take blocks a
    later session needs, so every chunk stays at the fixed size and no one stalls."""
    peak = BOUND.max_blocks(BLOCK, CHUNK)
    sessions = 3
    engine = make_engine(tiny_model, pool_blocks=sessions * peak)
    sids = [engine.open_session(Stream.of(SessionSpec(policy=BOUND, stop_token_ids=())))
            for _ in range(sessions)]
    for k, sid in enumerate(sids[:2]):
        engine.submit(sid, prompt(k), max_new_tokens=2)
    first = by_session(engine.step())
    assert [first[sid].input_tokens for sid in sids[:2]] == [CHUNK, CHUNK]
    engine.submit(sids[2], prompt(2), max_new_tokens=2)  # the third arrives mid-prefill
    for step in run(engine, sids):
        assert all(o.status is WorkStatus.OK for o in step.values()), step
        assert all(o.input_tokens <= CHUNK for o in step.values())


def test_with_blocks_to_spare_bounded_prefills_take_larger_chunks(tiny_model):
    engine = make_engine(tiny_model, pool_blocks=256)
    sids = [engine.open_session(Stream.of(SessionSpec(policy=BOUND, stop_token_ids=())))
            for _ in range(3)]
    for k, sid in enumerate(sids):
        engine.submit(sid, prompt(k), max_new_tokens=2)
    first = by_session(engine.step())
    assert [first[sid].input_tokens for sid in sids] == [64 // 3] * 3  # the budget, shared
