"""`VllmEngine`, the engine seam over vLLM: the same frames give the native engine's tokens,
the bound keeps a session longer than the pool going, and a dry pool is `stalled_kv`.

Two in-process vLLM engines (unbounded and bounded, ~30 s each to start), each shared by
the tests that need it and shut down after its module's last use.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                    reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

import torch  # noqa: E402

from metronome.corpus import play_text  # noqa: E402
from metronome.engine.engine import Engine, EngineConfig, SessionError  # noqa: E402
from metronome.engine.session import SessionSpec  # noqa: E402
from metronome.engine.types import WorkStatus  # noqa: E402
from metronome.kv.residency import ResidencyPolicy  # noqa: E402
from metronome.model.weights import bundled_model_dir, load_model, load_tokenizer  # noqa: E402
from metronome.stream import Stream  # noqa: E402
from metronome.vllm.engine import REQUEST_PREFIX, VllmEngine, VllmEngineConfig  # noqa: E402
from tests.steps import by_session  # noqa: E402
from tests.vllm.driving import drive, tokens  # noqa: E402

pytestmark = pytest.mark.model

BLOCK = 32  # vLLM's CPU attention takes multiples of 32
UNBOUNDED_POOL = 1024
BOUND = ResidencyPolicy.parse("sinks_window:4:64@absolute")
# (offset into the text, input tokens, output tokens): a frame that asks for nothing, a
# frame of one token, and longer ones
FRAMES = [(0, 12, 3), (12, 10, 0), (22, 14, 4), (36, 5, 1), (41, 30, 6), (71, 9, 2)]


@pytest.fixture(scope="module")
def text_ids():
    return load_tokenizer().encode(play_text("hamlet")).ids


@pytest.fixture(scope="module")
def unbounded():
    engine = VllmEngine.start(VllmEngineConfig(
        model_dir=str(bundled_model_dir()), pool_tokens=UNBOUNDED_POOL, block_size=BLOCK,
        max_model_len=4096, max_step_tokens=256, mode="eager"))
    yield engine
    engine.shutdown()


def test_same_frames_same_tokens_as_the_native_engine(unbounded, text_ids):
    sids, ours = drive(unbounded, FRAMES, text_ids)
    assert unbounded.pool_stats().used_blocks > 0
    for sid in sids:
        unbounded.close(sid)
    assert unbounded.pool_stats().used_blocks == 0  # every block back at close
    native = Engine(load_model("bundled", torch.float32),
                    EngineConfig(block_size=BLOCK, pool_tokens=UNBOUNDED_POOL))
    _, theirs = drive(native, FRAMES, text_ids)
    assert tokens(ours) == tokens(theirs)
    assert [len(t) for t in tokens(ours).values()] == [sum(f[2] for f in FRAMES)] * 2
    submitted = [sum(s.consumed_tokens for s in rows) for rows in ours.values()]
    assert submitted == [sum(f[1] for f in FRAMES)] * 2  # every input token accounted once
    assert all(s.status is WorkStatus.OK for rows in ours.values() for s in rows)


def test_cancelled_generation_stops_and_input_is_still_processed(unbounded, text_ids):
    sid = unbounded.open_session(Stream.of(SessionSpec()))
    unbounded.submit(sid, text_ids[:20], max_new_tokens=50)
    produced = []
    while len(produced) < 3:
        produced += by_session(unbounded.step())[sid].new_token_ids
    unbounded.cancel_generation(sid)
    unbounded.submit(sid, text_ids[20:28], max_new_tokens=0)
    submitted, after = 0, []
    for _ in range(50):
        if not unbounded.has_work:
            break
        outcome = by_session(unbounded.step())[sid]
        after += outcome.new_token_ids
        submitted += outcome.consumed_tokens
    assert not unbounded.has_work
    assert len(after) <= 1  # vLLM ends a turn at a step boundary: at most one more token
    assert submitted == 8  # the next frame's input went in after the cancelled turn
    unbounded.close(sid)


def test_bad_input_and_other_policies_are_refused(unbounded):
    with pytest.raises(SessionError, match="token ids only"):
        unbounded.check_input(None, torch.zeros(3, 576))
    with pytest.raises(SessionError, match=r"in \[0, 49152\)"):
        unbounded.check_input([1, 49152], None)
    with pytest.raises(SessionError, match="one residency policy"):
        unbounded.open_session(Stream.of(SessionSpec(policy=BOUND)))


def test_a_dry_pool_is_stalled_kv_never_a_hang(unbounded, text_ids):
    """Unbounded sessions fill the pool; the one that cannot get a block is reported
    stalled_kv at every step (vLLM itself would keep it waiting, silently, forever)."""
    spec = SessionSpec()
    sids = [unbounded.open_session(Stream.of(spec)) for _ in range(3)]
    statuses = {sid: set() for sid in sids}
    for frame in range(40):
        for k, sid in enumerate(sids):
            offset = 1000 * k + 16 * frame
            if not unbounded.sessions[sid].queued and unbounded.sessions[sid].running is None:
                unbounded.submit(sid, text_ids[offset:offset + 16], max_new_tokens=2)
        for _ in range(6):
            for outcome in by_session(unbounded.step()).values():
                statuses[outcome.session_id].add(outcome.status)
    pool = unbounded.pool_stats()
    assert pool.free_blocks <= 1  # the pool ran dry
    assert any(WorkStatus.STALLED_KV in s for s in statuses.values())
    for sid in sids:
        unbounded.close(sid)
    assert unbounded.pool_stats().used_blocks == 0


def test_a_preempted_session_is_stalled_kv_and_its_input_is_counted_once(unbounded, text_ids):
    """Two long turns outgrow the pool while generating: vLLM preempts one (frees its KV, to
    recompute it later). That session reads stalled_kv, never counts its input twice, and
    finishes its turn once the other session closes."""
    a, b = (unbounded.open_session(Stream.of(SessionSpec(stop_token_ids=()))) for _ in range(2))
    for sid, offset in ((a, 0), (b, 3000)):
        unbounded.submit(sid, text_ids[offset:offset + 400], max_new_tokens=200)
    submitted, produced, statuses = {a: 0, b: 0}, {a: 0, b: 0}, {a: set(), b: set()}
    preempted = set()
    for _ in range(2000):
        if not unbounded.has_work:
            break
        if a in unbounded.sessions and unbounded.sessions[a].running is None:
            unbounded.close(a)  # a's turn is done: its blocks free b
        for outcome in by_session(unbounded.step()).values():
            submitted[outcome.session_id] += outcome.consumed_tokens
            produced[outcome.session_id] += len(outcome.new_token_ids)
            statuses[outcome.session_id].add(outcome.status)
        preempted |= unbounded._preempted  # what vLLM's scheduler did this step
    assert not unbounded.has_work
    assert preempted, "the scenario must make vLLM preempt"
    victims = [sid for sid in (a, b) if f"{REQUEST_PREFIX}{sid}" in preempted]
    assert victims and all(WorkStatus.STALLED_KV in statuses[sid] for sid in victims)
    assert submitted == {a: 400, b: 400}  # once each, recompute or not
    assert produced == {a: 200, b: 200}
    unbounded.close(b)
    assert unbounded.pool_stats().used_blocks == 0
