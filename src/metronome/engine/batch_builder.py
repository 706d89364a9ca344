"""Turn the sessions scheduled for one step into a `ForwardBatch` (all index math, no model math).

Built once per step, shared by every layer: the write slots of new tokens, the gather order
of each session's resident blocks, and the attention mask that encodes the residency
semantics of `kv.residency` token by token (so chunking never changes what a query sees).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metronome.engine.session import Session
from metronome.kv.residency import Positions
from metronome.model.batch import ForwardBatch


@dataclass
class PlannedWork:
    session: Session
    chunk: torch.Tensor  # (n,) int64 token ids or (n, hidden) embeddings
    start_position: int  # absolute position of the chunk's first token
    logits_rows: str  # "all" | "last" | "none"
    samples: bool  # the chunk ends the session's input and a new token is due
    submitted: bool  # caller input (False: the session's own sampled token fed back)

    @property
    def num_tokens(self) -> int:
        return self.chunk.shape[0]


def build_batch(
    work: list[PlannedWork], embed, dtype: torch.dtype, block_size: int
) -> ForwardBatch:
    batch_size = len(work)
    q_len = max(w.num_tokens for w in work)
    max_blocks = max(len(w.session.table.logical_to_block_id) for w in work)
    ctx = max_blocks * block_size

    block_ids = torch.zeros(batch_size, max_blocks, dtype=torch.int64)
    block_logical = torch.full((batch_size, max_blocks), -1, dtype=torch.int64)
    query_pos = torch.full((batch_size, q_len), -1, dtype=torch.int64)
    window_start = torch.zeros(batch_size, q_len, dtype=torch.int64)
    sink_tokens = torch.zeros(batch_size, 1, 1, dtype=torch.int64)
    positions, sink_positions, slot_ids, padded_rows, logits_rows = [], [], [], [], []
    own_sink_cols = [0] * batch_size
    row = 0
    for b, w in enumerate(work):
        table, policy = w.session.table, w.session.spec.policy
        logical = torch.tensor(list(table.logical_to_block_id), dtype=torch.int64)
        physical = torch.tensor(list(table.logical_to_block_id.values()), dtype=torch.int64)
        block_ids[b, : len(logical)] = physical
        block_logical[b, : len(logical)] = logical
        pos = torch.arange(w.start_position, w.start_position + w.num_tokens)
        starts = _window_starts(pos, policy.window_tokens, block_size)
        query_pos[b, : w.num_tokens] = pos
        window_start[b, : w.num_tokens] = starts
        sink_tokens[b] = policy.sink_tokens
        positions.append(pos)
        if policy.positions is Positions.ROLLING and policy.sink_tokens:
            # a young session may hold fewer blocks than its sinks span: never past C
            own_sink_cols[b] = min(table.num_sink_blocks, len(logical)) * block_size
            # the query's slot in the StreamingLLM cache: sinks first, then the window
            sink_positions.append(torch.clamp(starts, max=policy.sink_tokens) + pos - starts)
        else:
            sink_positions.append(pos)
        # logical blocks are sorted, so searchsorted finds each token's block
        slot_ids.append(physical[torch.searchsorted(logical, pos // block_size)] * block_size
                        + pos % block_size)
        padded_rows.append(b * q_len + torch.arange(w.num_tokens))
        if w.logits_rows == "all":
            logits_rows.append(row + torch.arange(w.num_tokens))
        elif w.logits_rows == "last":
            logits_rows.append(torch.tensor([row + w.num_tokens - 1]))
        row += w.num_tokens

    offsets = torch.arange(block_size)
    col_pos = (block_logical[:, :, None] * block_size + offsets).view(batch_size, 1, ctx)
    col_pos = torch.where(block_logical.repeat_interleave(block_size, 1)[:, None] >= 0, col_pos, -1)
    q = query_pos[:, :, None]
    attend = (col_pos >= 0) & (col_pos <= q) & (
        (col_pos < sink_tokens) | (col_pos >= window_start[:, :, None])
    )
    attend[:, :, 0] |= query_pos < 0  # padding queries see one slot: no NaN rows

    all_positions = torch.cat(positions)
    same_length = all(w.num_tokens == q_len for w in work)
    return ForwardBatch(
        inputs_embeds=_embeddings(work, embed, dtype),
        positions=all_positions,
        sink_positions=torch.cat(sink_positions) if max(own_sink_cols) else None,
        sink_cols=_sink_cols(own_sink_cols),
        slot_ids=torch.cat(slot_ids),
        block_ids=block_ids,
        padded_index=None if same_length else torch.cat(padded_rows),
        batch_size=batch_size,
        max_chunk_tokens=q_len,
        attend=attend.view(1, batch_size, 1, q_len, ctx),
        logits_index=torch.cat(logits_rows) if logits_rows else torch.zeros(0, dtype=torch.int64),
    )


def _sink_cols(own_sink_cols: list[int]) -> torch.Tensor | None:
    """(1, B, 1, n) mask of the leading columns scored against the rolling sink query."""
    n = max(own_sink_cols)
    if n == 0:
        return None
    cols = torch.arange(n)[None, :] < torch.tensor(own_sink_cols)[:, None]
    return cols.view(1, len(own_sink_cols), 1, n)


def _window_starts(pos: torch.Tensor, window_tokens: int | None, block_size: int):
    """Vectorised `ResidencyPolicy.window_start` over a chunk's positions."""
    if window_tokens is None:
        return torch.zeros_like(pos)
    first = pos - window_tokens + 1
    return torch.clamp(torch.div(first, block_size, rounding_mode="floor") * block_size, min=0)


def _embeddings(work: list[PlannedWork], embed, dtype: torch.dtype) -> torch.Tensor:
    """Embed token-id chunks in one lookup; splice in chunks that arrive as embeddings."""
    if all(w.chunk.dtype == torch.int64 for w in work):
        return embed(torch.cat([w.chunk for w in work]))
    parts = [
        embed(w.chunk) if w.chunk.dtype == torch.int64 else w.chunk.to(dtype) for w in work
    ]
    return torch.cat(parts)
