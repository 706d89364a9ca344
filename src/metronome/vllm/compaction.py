"""Block-table compaction: a kernel that scans every tile of a sequence pays O(S + W), not O(L).

vLLM's Triton kernel under R-SWA walks every tile from position 0 to the sequence's end and
masks the gap, so a bounded decode step costs O(L) even though it sees S + W keys (and it
reads the gap entries' blocks: vLLM's null block, or stale blocks another request now owns).
Compaction hands the kernel a shorter sequence instead: each request's sink blocks, then its
window blocks shifted down right behind them, with its length cut by the same whole number of
blocks. Shifting a key and its query by the same amount keeps every visibility decision:

    sink blocks (kept in place)      window blocks (moved down by `delta`)
    [0, n_sink * bs)                 [w_first * bs, L)  ->  [n_sink * bs, L - delta)
    delta = (w_first - n_sink) * bs, where w_first = the block holding the earliest
    position any query of this step sees in its window (first query - W + 1)

* j < S (a sink) is unmoved, and S <= n_sink * bs: still `j < S`.
* For a moved key and a query, `q - j` is unchanged: the window test `q - j < W` and
  causality hold exactly.
* The sink blocks' slots past S stay at their own positions j < n_sink * bs while every query
  moved to q' >= n_sink * bs + W - 1 (its window starts in or after block `w_first`), so
  `q' - j >= W`: invisible, as they were.

Positions for RoPE never change (the keys were stored rotated; queries come rotated from the
model), only the coordinates the attention kernel reasons in. No host sync: pure tensor ops
into caller-owned buffers, so CUDA graphs can keep replaying with the same addresses.
"""

from __future__ import annotations

import torch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def max_compacted_len(max_seq_len: int, max_query_len: int, sink_tokens: int,
                      window_tokens: int, block_size: int) -> int:
    """An upper bound on any compacted length (the kernel's `max_seqlen_k`): the sink blocks,
    the window before the first query, the queries, and the window's partial first block."""
    sink_span = ceil_div(sink_tokens, block_size) * block_size
    return min(max_seq_len, sink_span + window_tokens + max_query_len + block_size - 1)


def compact_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, sink_tokens: int, window_tokens: int,
                        block_size: int, out_table: torch.Tensor | None = None,
                        out_seq_lens: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's table as sink blocks + window blocks, and its length cut to match.

    `block_table` (R, M) int32, `seq_lens` (R,) int32 (tokens including this step's),
    `query_start_loc` (R + 1,) int32. Writes into `out_table[:R, :M]` / `out_seq_lens[:R]`
    when given (persistent buffers), else into new tensors; returns the two views. A request
    whose window still touches its sink blocks is left as it is. Columns past a request's
    compacted length hold later original columns (clamped to the last): never read, the
    kernel stops at the request's length.
    """
    num_reqs, width = block_table.shape
    assert seq_lens.shape[0] >= num_reqs and query_start_loc.shape[0] >= num_reqs + 1, (
        "seq_lens / query_start_loc shorter than the block table's rows")
    seq = seq_lens[:num_reqs].to(torch.int64)
    starts = query_start_loc[: num_reqs + 1].to(torch.int64)
    first_query = seq - (starts[1:] - starts[:-1])
    window_first_block = torch.clamp(first_query - window_tokens + 1, min=0) // block_size
    sink_blocks = ceil_div(sink_tokens, block_size)
    shift = torch.clamp(window_first_block - sink_blocks, min=0)  # whole blocks
    columns = torch.arange(width, device=block_table.device)
    source = torch.where(columns[None, :] < sink_blocks, columns[None, :],
                         columns[None, :] + shift[:, None]).clamp_(max=width - 1)
    table = torch.gather(block_table, 1, source.to(torch.int64)).to(block_table.dtype)
    lengths = (seq - shift * block_size).to(seq_lens.dtype)
    if out_table is not None:
        assert out_table.shape[0] >= num_reqs and out_table.shape[1] >= width, (
            f"compacted-table buffer {tuple(out_table.shape)} smaller than {(num_reqs, width)}")
        out_table[:num_reqs, :width].copy_(table)
        table = out_table[:num_reqs, :width]
    if out_seq_lens is not None:
        out_seq_lens[:num_reqs].copy_(lengths)
        lengths = out_seq_lens[:num_reqs]
    return table, lengths
