"""The memory side of a capacity plan: how many blocks one session holds, how many sessions
a pool holds, and when a pool of growing sessions runs dry. Pure arithmetic, no engine.

A session writes `tokens_per_frame` KV entries a frame (its input plus its output: see
`plan.schedule`) in chunks; the engine allocates a chunk's blocks *before* it slides the
window (`kv.block_table`), so a bounded session's peak is its sinks and window plus the
blocks of its largest chunk. For `sinks_window:S:W` with chunks of at most `c` tokens in
blocks of `b` the peak is at most

    ceil(S / b) + ceil((W + c - 2) / b) + 1      (34 blocks for 4 + 512, b = 16, c = 1)

and `peak_blocks` finds the exact peak of one session's chunk pattern by replaying it on a
real `BlockTable` (a pattern whose chunk starts never fall on some block offsets stays below
the bound). Unbounded sessions hold `ceil(tokens / b)` blocks and never stop growing.

The pool runs out of *blocks*, not tokens: N sessions growing alike at r tokens/s from block
boundaries each get floor(F / N) more blocks from F free ones, so the pool is dry at

    t_sat (block level) = floor(F / N) * b / r      (from the sessions' first frame)

The paper's first-order, token-level model pours the free room into the sessions as a fluid:
rho(t) = rho0 + N r t / P, t_sat = (1 - rho0) P / (N r) (P: the pool in tokens); it is later
by up to one block's worth of time per session.
"""

from __future__ import annotations

import math

from metronome.kv.block_pool import BlockPool
from metronome.kv.block_table import BlockTable
from metronome.kv.residency import ResidencyPolicy


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def peak_blocks_bound(policy: ResidencyPolicy, block_size: int, max_chunk_tokens: int) -> int:
    """Upper bound on the blocks a bounded session holds at once (see the module doc)."""
    if not policy.bounded:
        raise ValueError("an unbounded session has no peak: it grows until the pool is full")
    window = ceil_div(policy.window_tokens + max_chunk_tokens - 2, block_size) + 1
    return policy.num_sink_blocks(block_size) + window


def peak_blocks(policy: ResidencyPolicy, block_size: int, frame_chunks: list[int],
                num_frames: int) -> int:
    """Most blocks one session holds at any moment while it writes `num_frames` frames of
    chunks `frame_chunks` (tokens per engine step, e.g. [1, 12, 1, 1, 1]), replayed on a real
    `BlockTable`. Past the window, the count repeats with the frame start's offset in its
    block, which cycles within `block_size` frames: longer sessions replay only that far."""
    tokens_per_frame = sum(frame_chunks)
    if tokens_per_frame == 0 or num_frames == 0:
        return 0
    if policy.bounded:
        reach = policy.sink_tokens + policy.window_tokens + max(frame_chunks) + 2 * block_size
        num_frames = min(num_frames, ceil_div(reach, tokens_per_frame) + block_size + 1)
        capacity = peak_blocks_bound(policy, block_size, max(frame_chunks))
    else:
        capacity = ceil_div(tokens_per_frame * num_frames, block_size)
    pool, table, peak = BlockPool(capacity), BlockTable(policy, block_size), 0
    for _ in range(num_frames):
        for chunk in frame_chunks:
            assert table.append(chunk, pool), "the bound above is wrong"
            peak = max(peak, pool.num_used_blocks)
            table.slide(pool)
    return peak


def sessions_that_fit(free_blocks: int, blocks_per_session: int) -> int:
    """Sessions that can all hold `blocks_per_session` at once: the memory ceiling."""
    if blocks_per_session <= 0:
        raise ValueError(f"blocks_per_session must be positive, got {blocks_per_session}")
    return max(0, free_blocks) // blocks_per_session


def t_sat_token_level_s(prior_fraction: float, pool_tokens: int, num_sessions: int,
                        rate_tokens_per_s: float) -> float:
    """The paper's first-order model: t_sat = (1 - rho0) P / (N r); inf when nothing grows."""
    if num_sessions <= 0 or rate_tokens_per_s <= 0:
        return math.inf
    return (1 - prior_fraction) * pool_tokens / (num_sessions * rate_tokens_per_s)


def t_sat_block_level_s(free_blocks: int, block_size: int, num_sessions: int,
                        rate_tokens_per_s: float, peak_blocks_per_session: int | None) -> float:
    """When N sessions growing alike from block boundaries first find no block:
    floor(F / N) * b / r; inf when nothing grows or every session's peak fits."""
    if num_sessions <= 0 or rate_tokens_per_s <= 0:
        return math.inf
    blocks_each = max(0, free_blocks) // num_sessions
    if peak_blocks_per_session is not None and peak_blocks_per_session <= blocks_each:
        return math.inf  # bounded sessions stop growing first
    return blocks_each * block_size / rate_tokens_per_s
