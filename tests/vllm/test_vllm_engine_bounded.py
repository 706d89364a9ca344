"""`VllmEngine` with the sinks+window bound: a session far longer than the pool runs on,
its sink block pinned and its live blocks within vLLM's per-request reservation, in vLLM's
default mode (the model compiled) and bf16, as users run it: on a CPU with AMX, the bounded
layers read the AMX cache layout in place (they once fell back to the gather path there).

Its own module: its engine must not share the process with another module's engine.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                    reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

from metronome.corpus import play_text  # noqa: E402
from metronome.engine.session import SessionSpec  # noqa: E402
from metronome.engine.types import WorkStatus  # noqa: E402
from metronome.kv.residency import ResidencyPolicy  # noqa: E402
from metronome.model.weights import bundled_model_dir, load_tokenizer  # noqa: E402
from metronome.vllm.attention import PATH_CALLS  # noqa: E402
from metronome.vllm.engine import VllmEngine, VllmEngineConfig  # noqa: E402
from tests.vllm.driving import drive  # noqa: E402

pytestmark = pytest.mark.model

BOUND = ResidencyPolicy.parse("sinks_window:4:64@absolute")
BLOCK = 32


def test_a_bounded_session_far_longer_than_the_pool_runs_on():
    text_ids = load_tokenizer().encode(play_text("hamlet")).ids
    engine = VllmEngine.start(VllmEngineConfig(
        model_dir=str(bundled_model_dir()), policy=BOUND, pool_tokens=512, block_size=BLOCK,
        max_model_len=8192, max_step_tokens=64, max_chunk_tokens=64, dtype="bfloat16",
        mode="default"))
    try:
        assert not engine.llm.vllm_config.model_config.enforce_eager  # compiled
        ceiling = engine.memory_ceiling(BOUND)
        per_session = engine.num_blocks // ceiling
        frames = [(32 * i, 32, 2) for i in range(60)]  # 1,920 input + 120 output tokens
        sids, steps = drive(engine, frames, text_ids, sessions=1,
                            spec=SessionSpec(policy=BOUND))
        rows = steps[sids[0]]
        assert all(s.status is WorkStatus.OK for s in rows)
        assert sum(len(s.new_token_ids) for s in rows) == 120
        resident = engine.resident_tokens_by_session()[sids[0]]
        assert engine.sessions[sids[0]].computed > 3 * engine.num_blocks * BLOCK > resident
        assert engine.pool_stats().used_blocks <= per_session
        assert engine.pool_stats().pinned_blocks == 1  # the sink block
        # past S + W every bounded layer ran the in-place kernel, never the gather fallback
        assert PATH_CALLS["in_place"] > 0 and PATH_CALLS["gather"] == 0
        engine.close(sids[0])
        assert engine.pool_stats().used_blocks == 0
    finally:
        engine.shutdown()
