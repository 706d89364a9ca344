"""The plugin's in-place kernel against vLLM's own CPU attention with its sliding window,
one layer at a time, on the cache layout vLLM picks here (AMX's for bf16 on a CPU with AMX).

SmolLM2's attention shape (9 heads, 3 KV heads, head size 64), block size 32, S = 4 and
W = 512 against vLLM's window of 516, N sequences of L = 1,024 tokens, a query row each
(decode) or 16 (a chunk). The cache is copied into 24 "layers" the timing cycles through, so
the blocks come from memory as in a real step, not from the caches. Prints ms per layer,
the median of 5 rounds. Run from .venv-vllm:

    .venv-vllm/bin/python scripts/vllm_kernel_vs_stock.py --sessions 64 --queries 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from vllm import _custom_ops as ops

from metronome.vllm.config import SinksWindow
from metronome.vllm.kernel import in_place_kernel

H, KVH, D, BS, S, W, LAYERS = 9, 3, 64, 32, 4, 512, 24


def cache_for(isa: str, n: int, length: int, queries: int):
    gen = torch.Generator().manual_seed(0)
    blocks = -(-length // BS)
    num_blocks = 1 + n * blocks
    cache = torch.zeros(num_blocks, KVH, BS, 2 * D, dtype=torch.bfloat16)
    key_cache, value_cache = cache.view(num_blocks, KVH, 2 * BS, D).chunk(2, dim=2)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(n, -1)
    for r in range(n):
        k, v = (torch.randn(length, KVH, D, generator=gen).bfloat16() for _ in range(2))
        pos = torch.arange(length)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache,
                                       table[r, pos // BS] * BS + pos % BS, isa)
    query = torch.randn(n * queries, H, D, generator=gen).bfloat16()
    qsl = torch.arange(0, n * queries + 1, queries, dtype=torch.int32)
    return cache, table.int(), query, qsl


def per_layer_ms(fn, reps: int = 5) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - started) / reps / LAYERS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--queries", type=int, default=1, help="query rows per sequence")
    parser.add_argument("--length", type=int, default=1024)
    args = parser.parse_args()
    torch.cpu._init_amx()  # the AMX tile state, as vLLM's worker asks for it
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.bfloat16, BS, D)
    n, q = args.sessions, args.queries
    seq = torch.full((n,), args.length, dtype=torch.int32)
    cache, table, query, qsl = cache_for(isa, n, args.length, q)
    layers = [cache.clone() for _ in range(LAYERS)]
    parts = [c.view(c.shape[0], KVH, 2 * BS, D).chunk(2, dim=2) for c in layers]
    kernel = in_place_kernel(isa, BS, D, torch.bfloat16)
    out = torch.empty_like(query)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=n, num_heads=H, num_kv_heads=KVH, head_dim=D, seq_lens=seq,
        dtype=torch.bfloat16, query_start_loc=qsl, causal=True, sliding_window_size=S + W,
        isa=isa, enable_kv_split=False)

    def ours():
        for layer in layers:
            kernel(query, layer, qsl, seq, table, SinksWindow(S, W), D**-0.5, out)

    def stock():
        for key_cache, value_cache in parts:
            ops.cpu_attention_with_kv_cache(
                query=query, key_cache=key_cache, value_cache=value_cache, output=out,
                query_start_loc=qsl, seq_lens=seq, scale=D**-0.5, causal=True,
                alibi_slopes=None, sliding_window=S + W, block_table=table, softcap=0.0,
                scheduler_metadata=metadata, s_aux=None)

    rounds = [(per_layer_ms(ours), per_layer_ms(stock)) for _ in range(5)]
    mine, theirs = (statistics.median(r[i] for r in rounds) for i in (0, 1))
    print(f"isa {isa}, N={n}, {q} quer{'y' if q == 1 else 'ies'} each, L={args.length}: "
          f"plugin {mine:.3f} ms/layer, vLLM's sliding window {theirs:.3f} ms/layer "
          f"({mine / theirs:.2f}x)")


if __name__ == "__main__":
    main()
