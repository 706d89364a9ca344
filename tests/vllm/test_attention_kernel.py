"""The gather path (the fallback when the in-place kernel cannot serve) against vLLM's own CPU
kernel and a dense reference (no engine).

Four requests in one batch (decode steps past S + W, which run batched, a prefill chunk and
a decode step inside S + W), K/V written by the kernel's own cache writer into shuffled
physical blocks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                    reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from metronome.vllm.attention import GatherPlan, sinks_window_attention  # noqa: E402
from metronome.vllm.config import SinksWindow  # noqa: E402
from metronome.vllm.layout import cell_offsets  # noqa: E402
from tests.vllm.attention_reference import dense_reference  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 9, 3, 64  # SmolLM2's attention shape
SEQ_LENS, QUERY_LENS = [300, 200, 260, 30], [1, 40, 1, 1]
SCALE = HEAD_SIZE**-0.5


def make_batch(isa: str, block_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(SEQ_LENS) // block_size)
    num_blocks = 1 + len(SEQ_LENS) * max_blocks  # block 0 plays vLLM's null block
    cache = torch.zeros(num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE)
    key_cache, value_cache = cache.view(num_blocks, NUM_KV_HEADS, 2 * block_size,
                                        HEAD_SIZE).chunk(2, dim=2)
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(len(SEQ_LENS), -1)
    keys, values = [], []
    for r, seq_len in enumerate(SEQ_LENS):
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
        pos = torch.arange(seq_len)
        slots = physical[r, pos // block_size] * block_size + pos % block_size
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(QUERY_LENS), NUM_HEADS, HEAD_SIZE, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(QUERY_LENS).cumsum(0).tolist()], dtype=torch.int32)
    return cache, key_cache, value_cache, physical.int(), keys, values, query, qsl


def stock_kernel(isa, cache_parts, query, qsl, block_table, sliding_window):
    _, key_cache, value_cache = cache_parts
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(SEQ_LENS), num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_SIZE, seq_lens=seq_lens, dtype=torch.float32, query_start_loc=qsl,
        causal=True, sliding_window_size=sliding_window, isa=isa, enable_kv_split=False,
    )
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=qsl, seq_lens=seq_lens, scale=SCALE, causal=True, alibi_slopes=None,
        sliding_window=sliding_window, block_table=block_table, softcap=0.0,
        scheduler_metadata=metadata, s_aux=None,
    )
    return out


def ours(isa, block_size, cache, query, qsl, block_table, bound):
    offsets = cell_offsets(isa, block_size, HEAD_SIZE, torch.float32)
    plan = GatherPlan.build(qsl, torch.tensor(SEQ_LENS, dtype=torch.int32), block_table,
                            bound, offsets, NUM_KV_HEADS)
    out = torch.full_like(query, float("nan"))
    sinks_window_attention(query, cache, plan, SCALE, out)
    return out


ISAS = [("vec", 32), ("vec16", 16)]


@pytest.mark.parametrize(("isa", "block_size"), ISAS)
def test_full_window_equals_stock_kernel(isa, block_size):
    cache, kc, vc, table, _, _, query, qsl = make_batch(isa, block_size)
    expected = stock_kernel(isa, (cache, kc, vc), query, qsl, table, sliding_window=-1)
    got = ours(isa, block_size, cache, query, qsl, table, SinksWindow(0, 10_000))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("isa", "block_size"), ISAS)
def test_window_only_equals_stock_sliding_window(isa, block_size):
    """vLLM's sliding window is token-exact, p - j < W: the convention the bound uses."""
    cache, kc, vc, table, _, _, query, qsl = make_batch(isa, block_size)
    expected = stock_kernel(isa, (cache, kc, vc), query, qsl, table, sliding_window=50)
    got = ours(isa, block_size, cache, query, qsl, table, SinksWindow(0, 50))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("isa", "block_size"), ISAS)
def test_sinks_and_window_never_read_freed_blocks(isa, block_size):
    bound = SinksWindow(4, 50)
    cache, _, _, table, keys, values, query, qsl = make_batch(isa, block_size)
    cache[0] = float("nan")  # vLLM's null block: what a freed table entry points at
    for r, (seq_len, q_len) in enumerate(zip(SEQ_LENS, QUERY_LENS, strict=True)):
        first_window_block = max(0, seq_len - q_len - bound.window_tokens + 1) // block_size
        table[r, -(-bound.sink_tokens // block_size):first_window_block] = 0  # the freed gap
    got = ours(isa, block_size, cache, query, qsl, table, bound)
    expected = dense_reference(keys, values, query, SEQ_LENS, QUERY_LENS, bound, SCALE)
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)


def test_cell_offsets_are_a_permutation():
    offsets = cell_offsets("vec", 32, HEAD_SIZE, torch.float32)
    assert sorted(offsets.flatten().tolist()) == list(range(2 * 32 * HEAD_SIZE))
    # "vec" keeps values slot-major and keys transposed (dim-major) in each region
    assert offsets[1, 3, 5] == 32 * HEAD_SIZE + 3 * HEAD_SIZE + 5
    assert offsets[0, 3, 5] == 5 * 32 + 3
