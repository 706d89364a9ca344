"""Property tests: random open/submit/step/close sequences keep the pool's books exact."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.engine.types import WorkStatus
from metronome.kv.residency import ResidencyPolicy
from metronome.stream import Stream

BLOCK = 4
policies = st.one_of(
    st.just(ResidencyPolicy.unbounded()),
    st.builds(ResidencyPolicy.window, st.integers(1, 12), st.sampled_from(["absolute", "rolling"])),
    st.builds(ResidencyPolicy.sinks_window, st.integers(0, 6), st.integers(1, 12),
              st.sampled_from(["absolute", "rolling"]), st.sampled_from([None, 4, 12])),
)
actions = st.lists(
    st.one_of(
        st.tuples(st.just("open"), policies),
        st.tuples(st.just("submit"), st.integers(0, 7), st.integers(1, 9), st.integers(0, 3)),
        st.tuples(st.just("step")),
        st.tuples(st.just("close"), st.integers(0, 7)),
        st.tuples(st.just("rewind"), st.integers(0, 7), st.integers(0, 4)),
    ),
    max_size=40,
)


def check_books(engine: Engine) -> None:
    stats = engine.pool_stats()
    assert stats.free_blocks + stats.used_blocks == stats.num_blocks
    held = sum(len(s.table.logical_to_block_id) for s in engine.sessions.values())
    assert held == stats.used_blocks  # every used block belongs to exactly one session
    for session in engine.sessions.values():
        table, policy = session.table, session.spec.policy
        bound = policy.max_resident_tokens(BLOCK)
        if bound is not None:
            assert table.resident_tokens <= bound
        # the blocks actually held are exactly the sink blocks and the window's blocks (from
        # where a query at the rewind horizon would see, while the latest reply has one)
        if table.num_tokens:
            first = policy.window_start(table.num_tokens, BLOCK) // BLOCK
            if table.hold_from is not None:
                first = min(first, policy.window_start(table.hold_from, BLOCK) // BLOCK)
            window = range(first, (table.num_tokens - 1) // BLOCK + 1)
            sinks = range(min(table.num_sink_blocks, (table.num_tokens - 1) // BLOCK + 1))
            assert set(table.logical_to_block_id) == set(sinks) | set(window)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions)
# found by hypothesis: rolling sinks spanning more blocks than a young session holds yet
@example([("open", ResidencyPolicy.sinks_window(5, 1, "rolling")), ("submit", 0, 1, 0),
          ("step",)])
def test_random_sessions_keep_pool_books(tiny_model, script):
    engine = Engine(tiny_model, EngineConfig(block_size=BLOCK, pool_tokens=24 * BLOCK,
                                             max_chunk_tokens=5, max_step_tokens=12))
    open_ids: list[str] = []
    for action in script:
        if action[0] == "open":
            open_ids.append(engine.open_session(Stream.of(SessionSpec(policy=action[1]))))
        elif action[0] == "submit" and open_ids:
            sid = open_ids[action[1] % len(open_ids)]
            if not engine.sessions[sid].ended:
                engine.submit(sid, list(range(action[2])), max_new_tokens=action[3])
        elif action[0] == "step":
            result = engine.step()
            assert all(s in WorkStatus for s in result.status.values())
        elif action[0] == "close" and open_ids:
            engine.close(open_ids.pop(action[1] % len(open_ids)))
        elif action[0] == "rewind" and open_ids:
            session = engine.sessions[open_ids[action[1] % len(open_ids)]]
            reply = len(session.reply)
            if reply and not session.has_work:
                forgotten = engine.rewind_reply(session.id, min(action[2], reply))
                assert forgotten == reply - min(action[2], reply)
        check_books(engine)
    for _ in range(3):
        engine.step()
        check_books(engine)
    for sid in open_ids:
        engine.close(sid)
    assert engine.pool_stats().used_blocks == 0
