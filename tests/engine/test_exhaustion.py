"""Pool exhaustion is data: stalled sessions get `stalled_kv`, nothing raises, work resumes."""

from __future__ import annotations

import torch

from metronome.engine.engine import Engine, EngineConfig, SessionError
from metronome.engine.session import SessionSpec
from metronome.engine.types import WorkStatus
from metronome.kv.residency import ResidencyPolicy
from metronome.stream import Stream
from tests.steps import by_session

BLOCK = 4


def make_engine(model, blocks=10):
    return Engine(model, EngineConfig(block_size=BLOCK, pool_tokens=blocks * BLOCK,
                                      max_chunk_tokens=8, max_step_tokens=64))


def test_unbounded_sessions_stall_then_resume_after_a_close(tiny_model):
    engine = make_engine(tiny_model)
    sids = [engine.open_session(Stream.of()) for _ in range(3)]
    statuses = {s: [] for s in sids}
    for _ in range(4):  # each session writes 4 tokens (1 block) per round: 12 blocks wanted
        for sid in sids:
            engine.submit(sid, [1, 2, 3, 4])
        for sid, status in engine.step().status.items():
            statuses[sid].append(status)
    assert engine.pool_stats().free_blocks == 0
    stalled = [s for s in sids if WorkStatus.STALLED_KV in statuses[s]]
    assert stalled, statuses
    # the stalled session's input is kept, not lost
    victim = stalled[-1]
    assert engine.sessions[victim].has_work
    tokens_before = engine.session_tokens(victim)
    engine.close(sids[0] if sids[0] != victim else sids[1])
    outcome = by_session(engine.step())[victim]
    assert outcome.status is WorkStatus.OK and outcome.input_tokens == 4
    assert engine.session_tokens(victim) == tokens_before + 4


def test_bounded_session_runs_forever_in_the_same_small_pool(tiny_model):
    engine = make_engine(tiny_model, blocks=6)
    sid = engine.open_session(Stream.of(SessionSpec(policy=ResidencyPolicy.sinks_window(2, 8))))
    for _ in range(40):  # 160 tokens through a 24-slot pool
        engine.submit(sid, [5, 6, 7, 8])
        assert by_session(engine.step())[sid].status is WorkStatus.OK
    assert engine.session_tokens(sid) == 160
    assert engine.session_blocks(sid) <= 4


def test_max_session_tokens_is_a_distinct_outcome(tiny_model):
    engine = make_engine(tiny_model)
    sid = engine.open_session(Stream.of(SessionSpec(max_session_tokens=10)))
    other = engine.open_session(Stream.of())
    engine.submit(sid, list(range(8)))
    engine.submit(other, list(range(8)))
    assert by_session(engine.step())[sid].status is WorkStatus.OK
    engine.submit(sid, [1, 2, 3])
    engine.submit(other, [1, 2, 3])
    result = by_session(engine.step())
    assert result[sid].status is WorkStatus.CONTEXT_FULL
    assert result[other].status is WorkStatus.OK  # the neighbour is untouched
    try:
        engine.submit(sid, [1])
        raise AssertionError("an ended session must refuse input")
    except SessionError as err:
        assert "ended" in str(err)
    engine.close(sid)
    engine.close(other)
    assert engine.pool_stats().used_blocks == 0


def test_bad_input_raises_clearly_and_harms_no_one(tiny_model):
    engine = make_engine(tiny_model)
    good = engine.open_session(Stream.of())
    engine.submit(good, [1, 2, 3], max_new_tokens=2)
    bad = engine.open_session(Stream.of())
    vocab, hidden = tiny_model.config.vocab_size, tiny_model.config.hidden_size
    for kwargs, message in [
        ({"token_ids": [vocab]}, "token ids"),
        ({"token_ids": [[1, 2]]}, "1-D"),
        ({"embeddings": torch.zeros(3, hidden + 1)}, "embeddings"),
        ({"embeddings": torch.full((2, hidden), float("nan"))}, "NaN"),
        ({"token_ids": [1], "max_new_tokens": -1}, "max_new_tokens"),
    ]:
        try:
            engine.submit(bad, **kwargs)
            raise AssertionError(f"accepted {kwargs}")
        except SessionError as err:
            assert message in str(err)
    for spec, message in [
        (SessionSpec(policy=ResidencyPolicy.window(10**6)), "limit"),
        (SessionSpec(policy=ResidencyPolicy.sinks_window(1000, 8)), "limit"),
    ]:
        try:
            engine.open_session(Stream.of(spec))
            raise AssertionError(f"accepted {spec}")
        except SessionError as err:
            assert message in str(err)
    tokens = []
    while engine.has_work:
        tokens += by_session(engine.step())[good].new_token_ids
    assert len(tokens) == 2


def test_embeddings_and_token_ids_give_the_same_result(tiny_model):
    engine = make_engine(tiny_model)
    ids = [3, 1, 4, 1, 5, 9]
    a = engine.open_session(Stream.of(SessionSpec(return_logits=True)))
    b = engine.open_session(Stream.of(SessionSpec(return_logits=True)))
    engine.submit(a, ids)
    engine.submit(b, embeddings=tiny_model.embed(torch.tensor(ids)))
    result = by_session(engine.step())
    torch.testing.assert_close(result[a].logits, result[b].logits)


def test_seeded_sampling_is_reproducible(tiny_model):
    from metronome.engine.sampling import SamplingParams

    def run(seed):
        engine = make_engine(tiny_model, blocks=20)
        spec = SessionSpec(sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=seed),
                           stop_token_ids=())
        sid = engine.open_session(Stream.of(spec))
        engine.submit(sid, [1, 2, 3], max_new_tokens=12)
        out = []
        while engine.has_work:
            out += by_session(engine.step())[sid].new_token_ids
        return out

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_step_reports_what_the_runtime_needs(tiny_model):
    """Caller input vs fed-back tokens, generation state, cancellation, chosen ids."""
    engine = make_engine(tiny_model, blocks=20)
    sid = engine.open_session(Stream("a", spec=SessionSpec(stop_token_ids=())))
    assert sid == "a"  # the stream's own id: one id inside the process
    try:
        engine.open_session(Stream("a"))  # a duplicate
        raise AssertionError("opened a session twice")
    except SessionError as err:
        assert "already open" in str(err)
    engine.submit(sid, [1, 2, 3, 4, 5], max_new_tokens=3)
    first = by_session(engine.step())[sid]
    assert (first.input_tokens, first.consumed_tokens, len(first.new_token_ids)) == (5, 5, 1)
    assert first.generating and first.context_tokens == 5
    second = by_session(engine.step())[sid]  # the sampled token fed back: not caller input
    assert (second.input_tokens, second.consumed_tokens) == (1, 0) and second.generating
    engine.cancel_generation(sid)
    third = by_session(engine.step())[sid]  # the last token's KV is still written
    assert third.new_token_ids == [] and not third.generating and not engine.has_work
    assert engine.session_tokens(sid) == 7


def test_warm_up_leaves_the_engine_as_it_found_it(tiny_model):
    engine = make_engine(tiny_model, blocks=20)
    engine.warm_up()
    assert engine.pool_stats().used_blocks == 0 and not engine.sessions
    assert engine.open_session(Stream("metronome-warm-up")) == "metronome-warm-up"  # released
