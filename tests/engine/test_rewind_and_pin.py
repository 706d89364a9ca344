"""A session's latest reply rewinds exactly (`Engine.rewind_reply`: the KV of a session that
generated and then forgot its last tokens is the KV of one that never generated them, even
after its window slid during the reply); its pinned prefix can be rewritten (`Engine.repin`)
and its bound changed (`Engine.set_policy`) between steps."""

from __future__ import annotations

import pytest
import torch

from metronome.engine.engine import Engine, EngineConfig, SessionError
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.stream import Stream

BLOCK = 4
POLICY = ResidencyPolicy.sinks_window(4, 16)
PROMPT = [(7 * i + 3) % 96 for i in range(40)]
TURN = [5, 9, 11, 2, 40, 41]


def make_engine(model) -> Engine:
    return Engine(model, EngineConfig(block_size=BLOCK, pool_tokens=64 * BLOCK,
                                      max_chunk_tokens=16, max_step_tokens=64,
                                      max_prefill_chunk_tokens=16, max_sink_tokens=32))


def open_one(engine: Engine, sid: str, policy=POLICY) -> str:
    return engine.open_session(Stream(sid, spec=SessionSpec(policy=policy, stop_token_ids=(),
                                                            return_logits=True)))


def run(engine: Engine, sid: str) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits = [], []
    while engine.sessions[sid].has_work:
        out = engine.step()
        tokens += out.new_token_ids.get(sid, [])
        if sid in out.logits:
            logits.append(out.logits[sid])
    return tokens, logits


@pytest.mark.parametrize("keep", [0, 1, 7, 29, 30])
def test_a_rewound_reply_is_token_for_token_the_reply_never_generated(tiny_model, keep):
    long_engine, short_engine = make_engine(tiny_model), make_engine(tiny_model)
    open_one(long_engine, "long")
    long_engine.submit("long", PROMPT, max_new_tokens=30)
    reply, _ = run(long_engine, "long")
    assert len(reply) == 30  # the 16-token window slid past the reply's start meanwhile
    table = long_engine.sessions["long"].table
    assert table.hold_from == len(PROMPT)
    assert POLICY.window_start(table.num_tokens, BLOCK) > len(PROMPT)
    assert long_engine.rewind_reply("long", keep) == 30 - keep

    open_one(short_engine, "short")
    short_engine.submit("short", PROMPT, max_new_tokens=keep)
    assert run(short_engine, "short")[0] == reply[:keep]
    assert long_engine.session_tokens("long") == short_engine.session_tokens("short")

    long_engine.submit("long", TURN, max_new_tokens=12)
    short_engine.submit("short", TURN, max_new_tokens=12)
    (after, long_logits), (twin, short_logits) = run(long_engine, "long"), run(short_engine,
                                                                                 "short")
    assert after == twin and len(after) == 12
    assert all(torch.equal(a, b) for a, b in zip(long_logits, short_logits, strict=True))
    long_table, short_table = long_engine.sessions["long"].table, short_engine.sessions[
        "short"].table
    assert list(long_table.logical_to_block_id) == list(short_table.logical_to_block_id)
    assert long_table.hold_from == short_table.hold_from  # the new reply's horizon
    assert long_engine.pool_stats().used_blocks == short_engine.pool_stats().used_blocks


def test_the_horizon_holds_blocks_only_while_the_reply_is_the_latest(tiny_model):
    engine = make_engine(tiny_model)
    open_one(engine, "s")
    engine.submit("s", PROMPT, max_new_tokens=30)
    run(engine, "s")
    held = engine.session_blocks("s")
    assert held > POLICY.max_blocks(BLOCK)  # the reply's blocks beyond the bound
    engine.submit("s", TURN)  # input read: the horizon ends
    run(engine, "s")
    assert engine.session_blocks("s") <= POLICY.max_blocks(BLOCK)
    with pytest.raises(SessionError, match="no reply to rewind"):
        engine.rewind_reply("s", 0)


def test_a_session_generating_on_without_input_holds_one_reply_beyond_its_bound(tiny_model):
    """Free-running generation (budget after budget, no input between): each new budget is a
    new reply, so the horizon holds the latest budget's blocks only. Before, it held every
    block since the last input, and such a session outgrew its bound without end (the
    quality experiment's free-running arm stalled its pool)."""
    engine = make_engine(tiny_model)
    open_one(engine, "s")
    engine.submit("s", PROMPT, max_new_tokens=8)
    held = []
    for _ in range(12):  # 96 tokens generated: six windows' worth
        run(engine, "s")
        held.append(engine.session_blocks("s"))
        engine.submit("s", None, max_new_tokens=8)
    reply_blocks = -(-8 // BLOCK) + 1  # a budget's tokens, and the block its query starts in
    assert max(held) <= POLICY.max_blocks(BLOCK) + reply_blocks, held
    assert len(engine.sessions["s"].reply) == 0  # asked for: the next budget is a new reply
    run(engine, "s")
    assert engine.rewind_reply("s", 3) == 5  # the latest budget's reply still rewinds


def test_rewind_refusals(tiny_model):
    engine = make_engine(tiny_model)
    open_one(engine, "s")
    with pytest.raises(SessionError, match="no reply"):
        engine.rewind_reply("s", 0)
    engine.submit("s", PROMPT, max_new_tokens=3)
    run(engine, "s")
    with pytest.raises(SessionError, match=r"keep_tokens must be in \[0, 3\]"):
        engine.rewind_reply("s", 4)
    engine.submit("s", TURN)  # queued, not yet read
    with pytest.raises(SessionError, match="input waiting"):
        engine.rewind_reply("s", 1)


def pinned_kv(engine: Engine, sid: str, num_tokens: int) -> torch.Tensor:
    table = engine.sessions[sid].table
    slots = [table.logical_to_block_id[p // BLOCK] * BLOCK + p % BLOCK
             for p in range(num_tokens)]
    return engine.cache.k[:, :, slots]


def test_repin_rewrites_the_pinned_prefix_as_a_fresh_session_writes_it(tiny_model):
    first, second = [11 + i for i in range(10)], [50 + i for i in range(13)]
    engine = make_engine(tiny_model)
    open_one(engine, "s", ResidencyPolicy.sinks_window(len(first), 16))
    engine.submit("s", first)
    run(engine, "s")
    assert not engine.repin("s", second)  # the window still covers positions 10..12: later
    engine.submit("s", PROMPT)
    outs = [engine.step()]
    while engine.sessions["s"].has_work:
        outs.append(engine.step())
    notes = [r for o in outs for r in o.rebounds]
    assert [(r.reason, r.policy.sink_tokens) for r in notes] == [("pinned", 13)]
    assert engine.sessions["s"].spec.policy == ResidencyPolicy.sinks_window(13, 16)
    assert engine.session_blocks("s") <= ResidencyPolicy.sinks_window(13, 16).max_blocks(BLOCK)
    assert engine.pool_stats().used_blocks == engine.session_blocks("s")  # the old prefix freed

    fresh = make_engine(tiny_model)
    open_one(fresh, "f", ResidencyPolicy.sinks_window(13, 16))
    fresh.submit("f", second)
    run(fresh, "f")
    assert torch.equal(pinned_kv(engine, "s", 13), pinned_kv(fresh, "f", 13))
    # and once the window has passed them, a repin happens at once
    assert engine.repin("s", first)
    assert engine.sessions["s"].spec.policy.sink_tokens == len(first)
    fresh.close("f")
    open_one(fresh, "f", ResidencyPolicy.sinks_window(10, 16))
    fresh.submit("f", first)
    run(fresh, "f")
    assert torch.equal(pinned_kv(engine, "s", 10), pinned_kv(fresh, "f", 10))
    with pytest.raises(SessionError, match="outside the engine's limit"):
        engine.repin("s", list(range(33)))


def test_set_policy_grows_shrinks_and_refuses_unbounded_after_a_slide(tiny_model):
    engine = make_engine(tiny_model)
    open_one(engine, "s", ResidencyPolicy.sinks_window(4, 32))
    engine.submit("s", PROMPT)
    run(engine, "s")
    held = engine.session_blocks("s")
    freed = engine.set_policy("s", ResidencyPolicy.sinks_window(4, 8))
    assert freed > 0 and engine.session_blocks("s") == held - freed
    assert engine.set_policy("s", ResidencyPolicy.sinks_window(4, 32)) == 0  # grows: no loss
    with pytest.raises(SessionError, match="cannot become unbounded"):
        engine.set_policy("s", ResidencyPolicy.unbounded())
    with pytest.raises(SessionError, match="exceeds the engine's limit"):
        engine.set_policy("s", ResidencyPolicy.sinks_window(4, 10_000))
    young = open_one(engine, "young", ResidencyPolicy.sinks_window(4, 64))
    engine.submit(young, [1] * 20)
    run(engine, young)
    engine.set_policy(young, ResidencyPolicy.unbounded())  # nothing slid yet: exact


def test_the_memory_ceiling_counts_the_longest_reply_the_horizon_holds(tiny_model):
    """A reply of R tokens keeps the window where it began until input is read, and that
    input's chunk is written before it lets go: the session's peak is its bound, one chunk
    and R tokens (`blocks_per_session` with `max_reply_tokens`), past what the chunk's
    allowance alone covers, so the ceiling sized without R would admit sessions that stall."""
    from dataclasses import replace

    from metronome.engine.engine import blocks_per_session

    engine = make_engine(tiny_model)
    pool, allocate, used = engine.pool, engine.pool.allocate, [0]

    def allocate_and_note(num_blocks: int):  # the peak is mid-step: blocks before a slide
        got = allocate(num_blocks)
        used[0] = max(used[0], engine.pool_stats().used_blocks)
        return got

    pool.allocate = allocate_and_note  # type: ignore[method-assign]
    open_one(engine, "s")  # the one session: the pool's used blocks are its blocks
    engine.submit("s", PROMPT, max_new_tokens=30)
    for input_ids, budget in ((None, 0), (TURN * 2, 4)):
        if input_ids is not None:
            engine.submit("s", input_ids, max_new_tokens=budget)
        while engine.sessions["s"].has_work:
            engine.step()
    peak = used[0]
    with_reply = replace(engine.config, max_reply_tokens=30)
    assert blocks_per_session(POLICY, engine.config) < peak  # the old count: too few
    assert peak <= blocks_per_session(POLICY, with_reply), peak
