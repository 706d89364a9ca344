"""The scheduler side, exact and without a model: vLLM's own KVCacheManager and BlockPool
driving SinksWindowManager through a 10k-token session (prefill chunks, then decode)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                    reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from metronome.vllm.spec import SinksWindowManager, SinksWindowSpec, register_spec  # noqa: E402

BLOCK = 16
S, W = 20, 100  # two sink blocks, the second one half sinks
CHUNK = 64  # prefill chunk = max tokens in flight


def make_spec(sink_tokens=S, window_tokens=W, in_flight=CHUNK, block_size=BLOCK):
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=3, head_size=64,
                             dtype=torch.float32)
    return SinksWindowSpec.from_full_attention(full, sink_tokens, window_tokens, in_flight)


def make_manager(num_blocks: int, caching: bool = False) -> KVCacheManager:
    register_spec()
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], make_spec())])
    return KVCacheManager(config, max_model_len=1 << 20, scheduler_block_size=BLOCK,
                          hash_block_size=BLOCK, max_in_flight_tokens=CHUNK,
                          enable_caching=caching)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int) -> Request:
    init_none_hash(sha256)
    return Request(request_id, list(range(num_prompt_tokens)),
                   SamplingParams(max_tokens=max_tokens), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def expected_live_blocks(computed: int, new: int) -> list[int]:
    """Logical blocks held after allocating `new` tokens on top of `computed` settled ones."""
    sinks = -(-S // BLOCK)
    first_window = max(sinks, max(0, computed - W + 1) // BLOCK)
    return list(range(sinks)) + list(range(first_window, -(-(computed + new) // BLOCK)))


def test_registry_keeps_builtins_and_maps_ours():
    register_spec()
    assert KVCacheSpecRegistry.get_manager_class(make_spec()) is SinksWindowManager
    plain = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    assert KVCacheSpecRegistry.get_manager_class(plain) is FullAttentionManager


def test_merge_keeps_the_bound():
    merged = SinksWindowSpec.merge([make_spec(), make_spec()])
    assert merged == make_spec()
    with pytest.raises(AssertionError, match="one sinks\\+window bound"):
        SinksWindowSpec.merge([make_spec(), make_spec(window_tokens=W + 1)])


def test_memory_bound_does_not_grow_with_max_model_len():
    spec = make_spec()
    per_request = 2 + (-(-(W - 1 + CHUNK) // BLOCK)) + 1  # sinks + window + in flight + 1
    for max_model_len in (8192, 1 << 20):
        config = SimpleNamespace(max_in_flight_tokens=CHUNK,
                                 model_config=SimpleNamespace(max_model_len=max_model_len))
        assert spec.max_memory_usage_bytes(config) == per_request * spec.page_size_bytes
    assert spec.max_admission_blocks_per_request(CHUNK, max_model_len=40) == 3  # short cap


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_ten_thousand_tokens_pin_sinks_and_stay_bounded(caching):
    num_blocks = 64
    kv = make_manager(num_blocks, caching)
    manager = kv.coordinator.single_type_managers[0]
    assert isinstance(manager, SinksWindowManager)
    bound = make_spec().max_admission_blocks_per_request(CHUNK, 1 << 20)
    prompt, generated = 6000, 4000
    request = make_request("session", prompt, generated)
    sink_ids = None
    peak = 0
    while request.num_computed_tokens < prompt + generated:
        computed = request.num_computed_tokens
        new = min(CHUNK, prompt - computed) if computed < prompt else 1
        assert kv.allocate_slots(request, new) is not None
        table = manager.req_to_blocks["session"]
        live = [i for i, b in enumerate(table) if not b.is_null]
        assert live == expected_live_blocks(computed, new)
        assert len(live) <= bound
        peak = max(peak, len(live))
        ids = [b.block_id for b in table[:2]]
        sink_ids = sink_ids or ids
        assert ids == sink_ids  # the sink blocks: the same two, never freed
        assert kv.block_pool.get_num_free_blocks() == num_blocks - 1 - len(live)
        request.num_computed_tokens += new
        if request.num_computed_tokens >= prompt:
            request.append_output_token_ids(7)
    assert request.num_computed_tokens == 10_000
    assert peak < num_blocks - 1  # a 10k-token session in a 63-block (1008-token) pool
    kv.free(request)
    assert kv.block_pool.get_num_free_blocks() == num_blocks - 1  # all but vLLM's null block


def test_pool_smaller_than_the_bound_is_capacity_not_a_crash():
    kv = make_manager(num_blocks=6)
    request = make_request("big", 500, 1)
    assert kv.allocate_slots(request, CHUNK) is not None  # 4 blocks of the 5 usable
    request.num_computed_tokens += CHUNK
    assert kv.allocate_slots(request, CHUNK) is None  # would need 8: refused, nothing broken
    kv.free(request)
    assert kv.block_pool.get_num_free_blocks() == 5
