"""The in-place sinks+window kernel against a dense fp64 reference (no engine).

K/V are written by vLLM's own cache writer into shuffled physical blocks; the batches mix
decode rows and chunk rows of 2, 16 and 64 tokens, with the window starting inside the
sink block, right after it, and far past it; the gap's table entries are churned (the null
block, filled with NaN, or a block another request now owns). The kernel must match the
reference within fp tolerance and leave every byte of the cache as it found it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                    reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from metronome.vllm.attention import GatherPlan, sinks_window_attention  # noqa: E402
from metronome.vllm.config import SinksWindow  # noqa: E402
from metronome.vllm.kernel import KERNEL, NULL_BLOCK_ID, in_place_kernel  # noqa: E402
from metronome.vllm.layout import LAYOUT_CODES, cell_offsets, key_layout  # noqa: E402
from tests.vllm.attention_reference import dense_reference  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 9, 3, 64  # SmolLM2's attention shape
SCALE = HEAD_SIZE**-0.5
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SLOT_MAJOR, DIM_MAJOR = LAYOUT_CODES["slot_major"], LAYOUT_CODES["dim_major"]


def amx_writer() -> bool:
    """vLLM's AMX cache writer is in this build (it lays bf16 out for AMX tiles; writing
    needs no AMX, but only a CPU with AMX serves with it)."""
    try:
        cell_offsets("amx", 32, HEAD_SIZE, torch.bfloat16)
    except RuntimeError:
        return False
    return True


# the writers vLLM picks: "vec" (fp32, or bf16 without AMX), "vec16" (block 16), and "amx"
# (bf16 on a CPU with AMX tiles, blocks of 32k: VNNI pairs)
WRITERS = [("vec", 32, None), ("vec", 64, None), ("vec16", 16, None),
           ("amx", 32, torch.bfloat16), ("amx", 64, torch.bfloat16)]


@pytest.fixture(scope="module")
def module():
    if KERNEL.module() is None:
        pytest.fail(f"the in-place kernel is not available: {KERNEL.reason()}")
    return KERNEL.module()


def make_batch(isa, block_size, dtype, seq_lens, query_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = 1 + len(seq_lens) * max_blocks  # block 0 plays vLLM's null block
    cache = torch.randn(num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE,
                        generator=gen).to(dtype)  # garbage where nothing is written
    key_cache, value_cache = cache.view(num_blocks, NUM_KV_HEADS, 2 * block_size,
                                        HEAD_SIZE).chunk(2, dim=2)
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(len(seq_lens), -1)
    keys, values = [], []
    for r, seq_len in enumerate(seq_lens):
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        slots = physical[r, pos // block_size] * block_size + pos % block_size
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return cache, physical.int(), keys, values, query, qsl


def churn_gap(cache, table, seq_lens, query_lens, bound, block_size):
    """Point every freed gap entry at the NaN-filled null block (even requests) or at a
    block another request owns (odd requests), as vLLM's worker tables may."""
    cache[NULL_BLOCK_ID] = float("nan")
    for r, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        first_window_block = max(0, seq_len - q_len - bound.window_tokens + 1) // block_size
        gap = slice(-(-bound.sink_tokens // block_size), first_window_block)
        other = table[(r + 1) % len(seq_lens), 0].item()
        table[r, gap] = NULL_BLOCK_ID if r % 2 == 0 else other


def run_kernel(isa, block_size, cache, query, qsl, seq_lens, table, bound):
    kernel = in_place_kernel(isa, block_size, HEAD_SIZE, cache.dtype)
    assert kernel is not None
    out = torch.full_like(query, float("nan"))
    kernel(query, cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), table, bound, SCALE,
           out)
    return out


# (sinks, window) x a mixed batch: decode rows and chunks of 2, 16 and 64 tokens, long and
# short sequences. At block size 32, S = 4: the window of the 300-token decode starts at
# 251; (4, 40) puts window starts inside the sink block (seq 40: 1, inside S + W) and right
# after it; (40, 100) has two sink blocks, the second one partial.
BOUNDS = [SinksWindow(4, 50), SinksWindow(4, 40), SinksWindow(40, 100), SinksWindow(0, 64),
          SinksWindow(4, 10_000)]
SEQ_LENS = [300, 200, 260, 30, 75, 72, 41, 1]
QUERY_LENS = [1, 16, 64, 1, 2, 16, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bound", BOUNDS, ids=str)
@pytest.mark.parametrize(("isa", "block_size", "only_dtype"), WRITERS)
def test_kernel_matches_the_dense_reference(module, isa, block_size, only_dtype, bound, dtype):
    if only_dtype is not None and dtype != only_dtype:
        pytest.skip(f"vLLM writes {isa} for {only_dtype} only")
    if isa == "amx" and not amx_writer():
        pytest.skip("this vLLM build has no AMX cache writer")
    cache, table, keys, values, query, qsl = make_batch(isa, block_size, dtype, SEQ_LENS,
                                                        QUERY_LENS)
    churn_gap(cache, table, SEQ_LENS, QUERY_LENS, bound, block_size)
    before = cache.clone()
    got = run_kernel(isa, block_size, cache, query, qsl, SEQ_LENS, table, bound)
    expected = dense_reference(keys, values, query, SEQ_LENS, QUERY_LENS, bound, SCALE)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))  # bit-identical


@pytest.mark.parametrize(("isa", "dtype"), [("vec", torch.float32), ("vec", torch.bfloat16),
                                            ("amx", torch.bfloat16)], ids=str)
def test_kernel_agrees_with_the_gather_path(module, isa, dtype):
    if isa == "amx" and not amx_writer():
        pytest.skip("this vLLM build has no AMX cache writer")
    bound, block_size = SinksWindow(4, 50), 32
    cache, table, _, _, query, qsl = make_batch(isa, block_size, dtype, SEQ_LENS, QUERY_LENS,
                                                seed=1)
    churn_gap(cache, table, SEQ_LENS, QUERY_LENS, bound, block_size)
    got = run_kernel(isa, block_size, cache, query, qsl, SEQ_LENS, table, bound)
    plan = GatherPlan.build(qsl, torch.tensor(SEQ_LENS, dtype=torch.int32), table, bound,
                            cell_offsets(isa, block_size, HEAD_SIZE, dtype), NUM_KV_HEADS)
    gathered = torch.full_like(query, float("nan"))
    sinks_window_attention(query, cache, plan, SCALE, gathered)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), gathered.float(), atol=tol, rtol=tol)


def test_slot_major_keys_read_the_same(module):
    """The kernel's other key layout, on a cache laid out by hand (slot-major keys)."""
    block_size, bound = 32, SinksWindow(4, 50)
    seq_lens, query_lens = [200, 90], [1, 16]
    gen = torch.Generator().manual_seed(2)
    blocks = -(-max(seq_lens) // block_size)
    cache = torch.randn(1 + 2 * blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE, generator=gen)
    table = (torch.randperm(2 * blocks, generator=gen) + 1).view(2, blocks).int()
    regions = cache.view(cache.shape[0], NUM_KV_HEADS, 2, block_size, HEAD_SIZE)
    keys, values = [], []
    for r, seq_len in enumerate(seq_lens):
        k, v = regions[table[r].long()].unbind(2)  # (blocks, kvh, bs, hd) slot-major
        keys.append(k.transpose(1, 2).reshape(-1, NUM_KV_HEADS, HEAD_SIZE)[:seq_len])
        values.append(v.transpose(1, 2).reshape(-1, NUM_KV_HEADS, HEAD_SIZE)[:seq_len])
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_SIZE, generator=gen)
    qsl = torch.tensor([0, 1, 17], dtype=torch.int32)
    out = torch.empty_like(query)
    module.sinks_window_attention(query, cache, qsl, torch.tensor(seq_lens, dtype=torch.int32),
                                  table, bound.sink_tokens, bound.window_tokens, SCALE, SLOT_MAJOR,
                                  NULL_BLOCK_ID, out)
    expected = dense_reference(keys, values, query, seq_lens, query_lens, bound, SCALE)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_a_visible_null_block_is_refused(module):
    """If the manager ever freed a block a query still sees, the step fails loudly."""
    bound, isa, block_size = SinksWindow(4, 50), "vec", 32
    cache, table, _, _, query, qsl = make_batch(isa, block_size, torch.float32, [300], [1])
    table[0, -1] = NULL_BLOCK_ID  # the block of the query's own key
    with pytest.raises(RuntimeError, match="null block: a freed block is still visible"):
        run_kernel(isa, block_size, cache, query, qsl, [300], table, bound)


def test_bad_shapes_are_refused(module):
    query = torch.randn(2, NUM_HEADS, HEAD_SIZE)
    cache = torch.randn(4, NUM_KV_HEADS, 32, 2 * HEAD_SIZE)
    qsl, lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    args = (cache, qsl, lens, table, 4, 50, SCALE, DIM_MAJOR, NULL_BLOCK_ID)
    with pytest.raises(RuntimeError, match="share a dtype"):
        module.sinks_window_attention(query.bfloat16(), *args,
                                      torch.empty_like(query, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="int32"):
        module.sinks_window_attention(query, cache, qsl.long(), lens, table, 4, 50, SCALE,
                                      DIM_MAJOR, NULL_BLOCK_ID, torch.empty_like(query))
    with pytest.raises(RuntimeError, match="layout must be"):
        module.sinks_window_attention(query, cache, qsl, lens, table, 4, 50, SCALE, 7,
                                      NULL_BLOCK_ID, torch.empty_like(query))
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        module.sinks_window_attention(query, cache, qsl, lens, table + 10, 4, 50, SCALE, DIM_MAJOR,
                                      NULL_BLOCK_ID, torch.empty_like(query))


def test_vllm_layouts_here_are_ones_the_kernel_reads():
    for isa, block_size in (("vec", 32), ("vec", 128), ("vec16", 16)):
        for dtype in (torch.float32, torch.bfloat16):
            assert key_layout(cell_offsets(isa, block_size, HEAD_SIZE, dtype)) == "dim_major"
    if amx_writer():  # what used to send every bounded bf16 layer on AMX to the gather path
        for block_size in (32, 64, 128):
            layout = key_layout(cell_offsets("amx", block_size, HEAD_SIZE, torch.bfloat16))
            assert layout == "amx_tiles"
