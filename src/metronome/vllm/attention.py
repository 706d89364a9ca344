"""The bound on the worker side: exact sinks+window attention for vLLM's CPU backend.

vLLM's CPU kernel (`ops.cpu_attention_with_kv_cache`) knows causal masking and a plain
sliding window, not "S sinks + a window with a freed gap between". So, per step:

* every sequence in the batch is no longer than S + W: every query sees every earlier
  key, which is plain causal attention -> the stock kernel, untouched;
* otherwise our in-place kernel (`metronome.vllm.kernel`): every query token reads its
  sink blocks and its window straight out of the paged cache, nothing copied;
* where that kernel cannot serve (no compiler, a cache layout it does not read), the
  reference gather path here: gather the keys any query can see (the S sinks and the
  window of its first query onwards; never a freed block) out of the paged cache: decode
  requests past S + W see exactly S + W keys, all visible, so they run as one batched
  SDPA; each other request runs SDPA with the mask `j <= p and (j < S or p - j < W)` at
  absolute positions p. It copies every visible K/V element per step: the slow path.

Where each K/V element sits is `metronome.vllm.layout`'s `cell_offsets`, learned from
vLLM's own cache writer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata

from metronome.vllm.backends import UnsupportedBackend, refused_features
from metronome.vllm.config import SinksWindow, bound_from_vllm_config
from metronome.vllm.kernel import in_place_kernel
from metronome.vllm.layout import cell_offsets

# Layer calls by path ("stock", "in_place", "gather") in this process: which one served
PATH_CALLS: Counter[str] = Counter()


def visible_key_positions(seq_len: int, num_queries: int, bound: SinksWindow) -> torch.Tensor:
    """Keys any of the last `num_queries` positions of a `seq_len` sequence may see."""
    first_query = seq_len - num_queries
    sinks = torch.arange(min(bound.sink_tokens, seq_len))
    window_start = max(bound.sink_tokens, first_query - bound.window_tokens + 1)
    window = torch.arange(min(window_start, seq_len), seq_len)  # empty inside the sinks
    return torch.cat((sinks, window))


def visibility_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, bound: SinksWindow
) -> torch.Tensor:
    """(queries, keys) bool: j <= p and (j < S or p - j < W)."""
    p, j = query_positions[:, None], key_positions[None, :]
    return (j <= p) & ((j < bound.sink_tokens) | (p - j < bound.window_tokens))


@dataclass(frozen=True)
class GatherPlan:
    """One step's reads, the same for every layer.

    Decode requests past S + W each see exactly S + W keys, all of them (the S sinks and the
    last W positions): they form one batch, gathered as (requests, kvh, S + W, hd) and
    attended by a single unmasked SDPA. Every other request with queries (prefill chunks,
    sequences shorter than S + W) keeps its own slice of the concatenated keys and its mask.
    """

    decode_rows: torch.Tensor  # (R,) int64: query rows of the batched decode requests
    decode_key_index: torch.Tensor  # (R, kvh, S + W, hd) int64 into the flattened cache
    decode_value_index: torch.Tensor
    key_index: torch.Tensor  # (kvh, n, hd) int64: keys of the other requests, concatenated
    value_index: torch.Tensor  # (kvh, n, hd)
    # per other request: (query start, query end, key start, key end, (q, k) mask)
    requests: list[tuple[int, int, int, int, torch.Tensor]]

    @classmethod
    def build(
        cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
        bound: SinksWindow, offsets: torch.Tensor, num_kv_heads: int,
    ) -> GatherPlan:
        _, block_size, _ = offsets.shape
        region_cells = offsets.numel()  # one (block, head) region: 2 * block_size * head_size
        heads = torch.arange(num_kv_heads)

        def index(keys_at: torch.Tensor, blocks: torch.Tensor, kind: int) -> torch.Tensor:
            """(..., kvh, keys, hd): cache cells of keys at `keys_at` in `blocks`."""
            region = (blocks[..., None, :, None] * num_kv_heads + heads[:, None, None]) \
                * region_cells
            return region + offsets[kind, keys_at % block_size][..., None, :, :]

        starts = query_start_loc.tolist()
        decode_rows, decode_keys, decode_blocks = [], [], []
        keys, blocks, requests, num_keys = [], [], [], 0
        for r, seq_len in enumerate(seq_lens.tolist()):
            start, end = starts[r], starts[r + 1]
            if end == start:
                continue
            keys_at = visible_key_positions(seq_len, end - start, bound)
            if end - start == 1 and seq_len >= bound.full_attention_tokens:
                assert len(keys_at) == bound.full_attention_tokens  # S + W, all visible
                decode_rows.append(start)
                decode_keys.append(keys_at)
                decode_blocks.append(block_table[r, keys_at // block_size].long())
                continue
            mask = visibility_mask(torch.arange(seq_len - (end - start), seq_len), keys_at, bound)
            keys.append(keys_at)
            blocks.append(block_table[r, keys_at // block_size].long())
            requests.append((start, end, num_keys, num_keys + len(keys_at), mask))
            num_keys += len(keys_at)
        empty = torch.zeros(num_kv_heads, 0, offsets.shape[2], dtype=torch.int64)
        if decode_rows:
            dk, db = torch.stack(decode_keys), torch.stack(decode_blocks)
            decode = (index(dk, db, 0), index(dk, db, 1))
        else:
            decode = (empty[None], empty[None])
        if keys:
            k_at, b_at = torch.cat(keys), torch.cat(blocks)
            rest = (index(k_at, b_at, 0), index(k_at, b_at, 1))
        else:
            rest = (empty, empty)
        return cls(torch.tensor(decode_rows, dtype=torch.int64), *decode, *rest, requests)


def sinks_window_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: GatherPlan, scale: float,
    output: torch.Tensor,
) -> None:
    """output[t] = attention of query[t] (tokens, heads, head_size) over its visible keys."""
    cells = kv_cache.view(-1)  # a view: the layer's cache is contiguous
    if len(plan.decode_rows):
        out = F.scaled_dot_product_attention(
            query[plan.decode_rows][:, :, None],  # (R, H, 1, hd)
            cells.take(plan.decode_key_index), cells.take(plan.decode_value_index),
            scale=scale, enable_gqa=True,  # (R, kvh, S + W, hd): every key visible
        )
        output[plan.decode_rows] = out[:, :, 0]
    if not plan.requests:
        return
    k = cells.take(plan.key_index)  # (kvh, n, hd)
    v = cells.take(plan.value_index)
    for start, end, key_start, key_end, mask in plan.requests:
        out = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1)[None],  # (1, H, q, hd)
            k[None, :, key_start:key_end], v[None, :, key_start:key_end],  # (1, kvh, n, hd)
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        output[start:end] = out[0].transpose(0, 1)  # (q, H, hd)


class SinksWindowCPUImpl(CPUAttentionBackendImpl):
    """CPU attention that honours the engine's sinks+window bound (stock when unset)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        bound = bound_from_vllm_config(get_current_vllm_config())
        self.bound = bound if self.attn_type == AttentionType.DECODER else None
        if self.bound is None:
            return
        found = refused_features(self) + (
            ["a model sliding window"] if self.sliding_window != -1 else [])
        if found:
            raise UnsupportedBackend(
                f"the sinks+window bound does not support {', '.join(found)}")

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            self.bound is None
            or attn_metadata is None
            or attn_metadata.max_seq_len <= self.bound.full_attention_tokens
            or output_scale is not None
            or output_block_scale is not None
        ):
            PATH_CALLS["stock"] += 1
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        md, n = attn_metadata, attn_metadata.num_actual_tokens
        kernel = in_place_kernel(layer.isa, kv_cache.shape[2], self.head_size, kv_cache.dtype)
        if kernel is None:
            PATH_CALLS["gather"] += 1
            plan = self._plan(layer.isa, kv_cache, md)
            sinks_window_attention(query[:n], kv_cache, plan, self.scale, output[:n])
            return output
        PATH_CALLS["in_place"] += 1
        out = output[:n].view(n, self.num_heads, self.head_size)
        into = out if out.is_contiguous() else torch.empty_like(out)
        kernel(query[:n].contiguous(), kv_cache, md.query_start_loc, md.seq_lens,
               md.block_table, self.bound, self.scale, into)
        if into is not out:
            out.copy_(into)
        return output

    def _plan(self, isa: str, kv_cache: torch.Tensor, md: CPUAttentionMetadata) -> GatherPlan:
        # One metadata object serves every layer of a step: build the plan once, keep it there.
        key = (isa, kv_cache.shape[2], self.head_size, kv_cache.dtype, self.bound)
        plans = md.__dict__.setdefault("_metronome_gather_plans", {})
        if key not in plans:
            offsets = cell_offsets(isa, kv_cache.shape[2], self.head_size, kv_cache.dtype)
            plans[key] = GatherPlan.build(md.query_start_loc, md.seq_lens, md.block_table,
                                          self.bound, offsets, kv_cache.shape[1])
        return plans[key]
