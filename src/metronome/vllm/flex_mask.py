"""The sinks+window rule as a FlexAttention block mask over a paged KV cache (no vLLM).

What vLLM's FlexAttention backend builds for R-SWA with the prefix at S (one query token per
mask row, as vLLM does under R-SWA so that requests never share a row's page list), written
for the GPU check, where vLLM is not installed:

* each query token's page list holds only its sink pages and its window pages, physical ids
  from the block table, so the kernel never loads a gap block;
* the mask_mod maps a physical slot back to its logical position through an inverse table
  and applies j <= p and (j < S or p - j < W) there, so slots of a listed page that are not
  visible (a sink block's slots past S, a window block's slots before the window) are masked.
"""

from __future__ import annotations

import torch


def paged_block_mask(block_table: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, sink_tokens: int, window_tokens: int,
                     block_size: int, num_blocks: int):
    """A `BlockMask` of (query tokens x cache slots) for one step's paged attention."""
    from torch.nn.attention.flex_attention import BlockMask

    device = block_table.device
    starts = query_start_loc.tolist()
    q_lens = torch.tensor([b - a for a, b in zip(starts, starts[1:], strict=False)],
                          device=device)
    num_reqs = q_lens.shape[0]
    request = torch.repeat_interleave(torch.arange(num_reqs, device=device), q_lens)
    local = torch.arange(request.shape[0], device=device) - query_start_loc[:-1].long()[request]
    position = (seq_lens[:num_reqs].long() - q_lens)[request] + local  # (T,)
    sink_pages = -(-sink_tokens // block_size)
    window_pages = -(-window_tokens // block_size) + 1
    last = position // block_size
    window_first = torch.clamp(torch.clamp(position - window_tokens + 1, min=0) // block_size,
                               min=sink_pages)
    sink_count = torch.clamp(last + 1, max=sink_pages)
    window_count = torch.clamp(last - window_first + 1, min=0)
    column = torch.arange(sink_pages + window_pages, device=device)[None, :]
    logical = torch.where(column < sink_count[:, None], column,
                          window_first[:, None] + column - sink_count[:, None])
    listed = column < (sink_count + window_count)[:, None]
    logical = torch.where(listed, logical, 0)
    physical = torch.gather(block_table[request].long(), 1, logical)
    kv_indices = torch.full((request.shape[0], column.shape[1] + 1), -1, dtype=torch.int32,
                            device=device)  # one more column: the kernel prefetches past the end
    kv_indices[:, :-1] = torch.where(listed, physical, -1).to(torch.int32)
    inverse = torch.full((num_reqs, num_blocks), -1, dtype=torch.long, device=device)
    rows = request[:, None].expand_as(physical)
    inverse[rows[listed], physical[listed]] = logical[listed]

    def mask_mod(b, h, q_idx, kv_idx):
        page = inverse[request[q_idx], kv_idx // block_size]
        key = page * block_size + kv_idx % block_size
        p = position[q_idx]
        return (page >= 0) & (key <= p) & ((key < sink_tokens) | (p - key < window_tokens))

    return BlockMask.from_kv_blocks(
        (sink_count + window_count).to(torch.int32)[None, None], kv_indices[None, None],
        BLOCK_SIZE=(1, block_size), mask_mod=mask_mod,
        seq_lengths=(request.shape[0], num_blocks * block_size), compute_q_blocks=False)


def flex_paged_attention(flex_attention, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, block_mask, scale: float) -> torch.Tensor:
    """`query` (T, H, D) over caches (blocks, block size, KV heads, D): (T, H, D). Pass torch's
    `flex_attention` eager (CPU) or compiled (GPU: only the listed pages are read)."""
    as_4d = lambda x: x.reshape(-1, x.shape[-2], x.shape[-1]).unsqueeze(0).permute(0, 2, 1, 3)  # noqa: E731
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 1,
               "BLOCK_N": key_cache.shape[1]} if query.is_cuda else None
    out = flex_attention(as_4d(query), as_4d(key_cache), as_4d(value_cache),
                         block_mask=block_mask, scale=scale, enable_gqa=True,
                         kernel_options=options)
    return out[0].permute(1, 0, 2)
