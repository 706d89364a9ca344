"""Turn the sessions planned for one step into a `ForwardBatch` (all index math, no model math).

Built once per step, shared by every layer: the write slots of new tokens, and for each
attention path what encodes the residency semantics of `kv.residency` token by token (so
chunking never changes what a query sees): the paged kernel's block tables and per-query
window starts, or the dense path's gather order and mask.
"""

from __future__ import annotations

from itertools import chain

import torch

from metronome.engine.session import Session
from metronome.kv.residency import Positions
from metronome.model.batch import DenseAttention, ForwardBatch, PagedAttention

# Chunks up to this many tokens take the paged kernel when it is available; longer ones
# (prefill) the dense path, whose fused SDPA does the many-query math as matrix products.
# 32: a streaming frame's chunk (16 tokens + the carried one) measured faster in place than
# gathered (SmolLM2 bf16, 2 cores: 17 tokens beside a decode row 22 vs 26 ms at a 516-token
# window, 87 vs 113 ms at 4k unbounded). 64 was tried and dropped: 8-session prefill in
# 64-token chunks went 0.96x -> 1.40x vLLM's time at 1k and 1.91x -> 2.53x at 4k.
PAGED_MAX_CHUNK_TOKENS = 32


def paged_first(work: list[Session], paged_max_chunk_tokens: int) -> list[Session]:
    """The step's work in the row order `build_batch` needs: chunks of at most
    `paged_max_chunk_tokens` tokens (the paged path) first, the rest after, each run in
    the order given (0: every chunk on the dense path)."""
    paged = [w for w in work if w.chunk_tokens <= paged_max_chunk_tokens]
    return paged + [w for w in work if w.chunk_tokens > paged_max_chunk_tokens]


def build_batch(
    work: list[Session], embed, dtype: torch.dtype, block_size: int,
    paged_max_chunk_tokens: int = 0,
) -> ForwardBatch:
    """One step's `ForwardBatch`. `work` in `paged_first` order: its leading chunks of at most
    `paged_max_chunk_tokens` tokens go to the paged kernel, the rest to the dense path."""
    num_paged = 0
    while num_paged < len(work) and work[num_paged].chunk_tokens <= paged_max_chunk_tokens:
        num_paged += 1
    assert all(w.chunk_tokens > paged_max_chunk_tokens for w in work[num_paged:]), \
        "work must be in paged_first order"
    positions: list[int] = []
    window_starts: list[int] = []
    sink_positions: list[int] = []
    slot_ids: list[int] = []
    logits_rows: list[int] = []
    any_rolling_sinks = False
    row = 0
    for w in work:
        table, policy = w.table, w.spec.policy
        blocks = table.logical_to_block_id
        rolling_sinks = policy.positions is Positions.ROLLING and policy.sink_tokens > 0
        any_rolling_sinks |= rolling_sinks
        for p in range(w.start_position, w.start_position + w.chunk_tokens):
            start = policy.window_start(p, block_size)
            positions.append(p)
            window_starts.append(start)
            slot_ids.append(blocks[p // block_size] * block_size + p % block_size)
            # rolling: the query's slot in the StreamingLLM cache, sinks first, then the window
            sink_positions.append(min(start, policy.sink_tokens) + p - start if rolling_sinks
                                  else p)
        if w.logits_rows == "all":
            logits_rows.extend(range(row, row + w.chunk_tokens))
        elif w.logits_rows == "last":
            logits_rows.append(row + w.chunk_tokens - 1)
        row += w.chunk_tokens

    lists = {"positions": positions, "slot_ids": slot_ids, "logits_index": logits_rows}
    if any_rolling_sinks:
        lists["sink_positions"] = sink_positions
    paged_lists = _paged_lists(work[:num_paged], positions, window_starts) if num_paged else {}
    tensors = _int64_tensors(lists | paged_lists)
    paged = None
    if num_paged:
        paged = PagedAttention(
            num_tokens=len(paged_lists["token_session"]),
            token_session=tensors["token_session"],
            token_positions=tensors["token_positions"],
            token_window_start=tensors["token_window_start"],
            block_ids=tensors["block_ids"].view(num_paged, -1),
            block_logical=tensors["block_logical"].view(num_paged, -1),
            num_blocks=tensors["num_blocks"],
            sink_tokens=tensors["sink_tokens"],
            sink_blocks=tensors["sink_blocks"],
        )
    return ForwardBatch(
        inputs_embeds=_embeddings(work, embed, dtype),
        positions=tensors["positions"],
        sink_positions=tensors.get("sink_positions"),
        slot_ids=tensors["slot_ids"],
        logits_index=tensors["logits_index"],
        paged=paged,
        dense=_dense(work[num_paged:], block_size) if num_paged < len(work) else None,
    )


def _int64_tensors(lists: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Each list as an int64 tensor: views of one tensor made by one `torch.tensor` call, not
    a call each (a paged decode step's 13 calls: `build_batch` 390 vs 331 us for 8 sessions
    on a Zen 1-class EPYC)."""
    flat = torch.tensor(list(chain.from_iterable(lists.values())), dtype=torch.int64)
    return dict(zip(lists, flat.split([len(values) for values in lists.values()]), strict=True))


def _paged_lists(work: list[Session], positions: list[int],
                 window_starts: list[int]) -> dict[str, list[int]]:
    """Block tables and per-query visibility bounds for the paged kernel, as lists named
    after `PagedAttention`'s fields (plain lists: a decode step has one token per session,
    and torch ops per session would cost more). `positions`, `window_starts`: the step's,
    per token; this part's tokens lead them. Block tables are padded to the longest."""
    max_blocks = max(len(w.table.logical_to_block_id) for w in work)
    block_ids, block_logical, num_blocks, sink_tokens, sink_blocks = [], [], [], [], []
    token_session = []
    for b, w in enumerate(work):
        table, policy = w.table, w.spec.policy
        blocks = table.logical_to_block_id
        pad = [0] * (max_blocks - len(blocks))
        block_ids.extend(list(blocks.values()) + pad)
        block_logical.extend(list(blocks) + pad)
        num_blocks.append(len(blocks))
        sink_tokens.append(policy.sink_tokens)
        rolling = policy.positions is Positions.ROLLING and policy.sink_tokens
        sink_blocks.append(min(table.num_sink_blocks, len(blocks)) if rolling else 0)
        token_session.extend([b] * w.chunk_tokens)
    num_tokens = len(token_session)
    return {"token_session": token_session, "token_positions": positions[:num_tokens],
            "token_window_start": window_starts[:num_tokens], "block_ids": block_ids,
            "block_logical": block_logical, "num_blocks": num_blocks,
            "sink_tokens": sink_tokens, "sink_blocks": sink_blocks}


def _dense(work: list[Session], block_size: int) -> DenseAttention:
    """Gather order, padding and the token-by-token mask of the dense reference path."""
    batch_size = len(work)
    q_len = max(w.chunk_tokens for w in work)
    max_blocks = max(len(w.table.logical_to_block_id) for w in work)
    ctx = max_blocks * block_size

    block_ids = torch.zeros(batch_size, max_blocks, dtype=torch.int64)
    block_logical = torch.full((batch_size, max_blocks), -1, dtype=torch.int64)
    query_pos = torch.full((batch_size, q_len), -1, dtype=torch.int64)
    window_start = torch.zeros(batch_size, q_len, dtype=torch.int64)
    sink_tokens = torch.zeros(batch_size, 1, 1, dtype=torch.int64)
    padded_rows = []
    own_sink_cols = [0] * batch_size
    for b, w in enumerate(work):
        table, policy = w.table, w.spec.policy
        logical = torch.tensor(list(table.logical_to_block_id), dtype=torch.int64)
        physical = torch.tensor(list(table.logical_to_block_id.values()), dtype=torch.int64)
        block_ids[b, : len(logical)] = physical
        block_logical[b, : len(logical)] = logical
        pos = torch.arange(w.start_position, w.start_position + w.chunk_tokens)
        query_pos[b, : w.chunk_tokens] = pos
        window_start[b, : w.chunk_tokens] = _window_starts(pos, policy.window_tokens,
                                                            policy.slide(block_size))
        sink_tokens[b] = policy.sink_tokens
        if policy.positions is Positions.ROLLING and policy.sink_tokens:
            # a young session may hold fewer blocks than its sinks span: never past C
            own_sink_cols[b] = min(table.num_sink_blocks, len(logical)) * block_size
        padded_rows.append(b * q_len + torch.arange(w.chunk_tokens))

    offsets = torch.arange(block_size)
    col_pos = (block_logical[:, :, None] * block_size + offsets).view(batch_size, 1, ctx)
    col_pos = torch.where(block_logical.repeat_interleave(block_size, 1)[:, None] >= 0, col_pos, -1)
    q = query_pos[:, :, None]
    attend = (col_pos >= 0) & (col_pos <= q) & (
        (col_pos < sink_tokens) | (col_pos >= window_start[:, :, None])
    )
    attend[:, :, 0] |= query_pos < 0  # padding queries see one slot: no NaN rows

    same_length = all(w.chunk_tokens == q_len for w in work)
    return DenseAttention(
        block_ids=block_ids,
        padded_index=None if same_length else torch.cat(padded_rows),
        batch_size=batch_size,
        max_chunk_tokens=q_len,
        attend=attend.view(1, batch_size, 1, q_len, ctx),
        sink_cols=_sink_cols(own_sink_cols),
    )


def _sink_cols(own_sink_cols: list[int]) -> torch.Tensor | None:
    """(1, B, 1, n) mask of the leading columns scored against the rolling sink query."""
    n = max(own_sink_cols)
    if n == 0:
        return None
    cols = torch.arange(n)[None, :] < torch.tensor(own_sink_cols)[:, None]
    return cols.view(1, len(own_sink_cols), 1, n)


def _window_starts(pos: torch.Tensor, window_tokens: int | None, step_tokens: int):
    """Vectorised `ResidencyPolicy.window_start` over a chunk's positions (`step_tokens`: the
    window's step, `ResidencyPolicy.slide`)."""
    if window_tokens is None:
        return torch.zeros_like(pos)
    first = pos - window_tokens + 1
    return torch.clamp(torch.div(first, step_tokens, rounding_mode="floor") * step_tokens, min=0)


def _embeddings(work: list[Session], embed, dtype: torch.dtype) -> torch.Tensor:
    """Embed token-id chunks in one lookup; splice in chunks that arrive as embeddings."""
    chunks = [w.chunk for w in work if w.chunk is not None]
    assert len(chunks) == len(work), "every session in a step has its chunk"
    if all(chunk.dtype == torch.int64 for chunk in chunks):
        return embed(torch.cat(chunks))
    parts = [embed(chunk) if chunk.dtype == torch.int64 else chunk.to(dtype) for chunk in chunks]
    return torch.cat(parts)
