"""A frame's input goes into the engine in one step with the token sampled last before it.

A session that answered its previous frame holds that frame's last sampled token (`carry`):
it is fed before the next input. Fed as a step of its own it cost every streaming frame one
extra engine step (5 steps for 16 tokens in and 4 out instead of 4). Consecutive pending
chunks of one kind now go in together, up to the chunk limit; what the model computes is
the same, as the logits at every position show against one-token-per-step feeding.
"""

from __future__ import annotations

import pytest
import torch

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.stream import Stream
from tests.steps import by_session

BLOCK = 4
FRAME = [7, 3, 9, 12, 5, 6, 2, 8]


def make_engine(model, max_chunk_tokens=16, **config):
    """Chunks of `max_chunk_tokens` always (the tests count steps: no larger prefill
    chunks, `engine.chunking`)."""
    return Engine(model, EngineConfig(block_size=BLOCK, pool_tokens=64 * BLOCK,
                                      max_chunk_tokens=max_chunk_tokens, max_step_tokens=64,
                                      max_prefill_chunk_tokens=max_chunk_tokens, **config))


def run_frame(engine, sid, frame, max_new_tokens):
    """Submit a frame, step until it is answered; the session's outcomes, step by step."""
    engine.submit(sid, frame, max_new_tokens=max_new_tokens)
    steps = []
    while engine.sessions[sid].has_work:
        steps.append(by_session(engine.step())[sid])
    return steps


def test_the_carried_token_goes_in_with_the_next_frame(tiny_model):
    engine = make_engine(tiny_model)
    sid = engine.open_session(Stream.of(SessionSpec(stop_token_ids=())))
    first = run_frame(engine, sid, FRAME, max_new_tokens=4)
    assert len(first) == 4 and engine.sessions[sid].carry  # 1 input step + 3 decode steps
    second = run_frame(engine, sid, FRAME, max_new_tokens=4)
    assert len(second) == 4, [s.input_tokens for s in second]
    assert (second[0].input_tokens, second[0].consumed_tokens) == (len(FRAME) + 1, len(FRAME))
    assert len(second[0].new_token_ids) == 1  # it samples: the frame's input is all in
    assert engine.session_tokens(sid) == 2 * (len(FRAME) + 4) - 1


def test_merged_chunks_respect_the_chunk_limit_and_count_caller_input(tiny_model):
    engine = make_engine(tiny_model, max_chunk_tokens=5)
    sid = engine.open_session(Stream.of(SessionSpec(stop_token_ids=())))
    run_frame(engine, sid, [1, 2], max_new_tokens=1)  # leaves a carried token
    engine.submit(sid, [3, 4, 5])
    engine.submit(sid, [6, 7, 8, 9])
    outcomes = [by_session(engine.step())[sid] for _ in range(2)]
    assert [(o.input_tokens, o.consumed_tokens) for o in outcomes] == [(5, 4), (3, 3)]
    assert not engine.has_work


def test_token_ids_and_embeddings_do_not_merge(tiny_model):
    engine = make_engine(tiny_model)
    sid = engine.open_session(Stream.of(SessionSpec(stop_token_ids=())))
    run_frame(engine, sid, FRAME, max_new_tokens=2)
    engine.submit(sid, embeddings=tiny_model.embed(torch.tensor(FRAME)), max_new_tokens=1)
    carry, frame = (by_session(engine.step())[sid] for _ in range(2))
    assert (carry.input_tokens, carry.consumed_tokens, carry.new_token_ids) == (1, 0, [])
    assert (frame.input_tokens, frame.consumed_tokens) == (len(FRAME), len(FRAME))
    assert len(frame.new_token_ids) == 1


@pytest.mark.parametrize("policy", [ResidencyPolicy.unbounded(),
                                    ResidencyPolicy.sinks_window(2, 8)])
@pytest.mark.parametrize("attention", ["auto", "dense"])
def test_merged_steps_compute_what_one_token_per_step_does(tiny_model, policy, attention):
    """Every position's logits over three frames (their carried tokens merged or not)."""
    def logits(max_chunk_tokens):
        engine = make_engine(tiny_model, max_chunk_tokens, attention=attention)
        sid = engine.open_session(Stream.of(SessionSpec(policy=policy, return_logits=True,
                                              stop_token_ids=())))
        rows, tokens = [], []
        for k in range(3):
            for outcome in run_frame(engine, sid, [(t + k) % 50 for t in FRAME], 3):
                rows.append(outcome.logits)
                tokens += outcome.new_token_ids
        return torch.cat(rows), tokens

    merged, tokens = logits(16)
    single, single_tokens = logits(1)
    assert tokens == single_tokens
    torch.testing.assert_close(merged, single, rtol=1e-4, atol=1e-4)
