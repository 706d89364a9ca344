"""`ForwardBatch`: the tensors one batched forward needs, built by the engine each step.

T = valid tokens in the step (all sessions' chunks back to back), B = sessions in the step,
Q = longest chunk, C = gathered context slots per session (max blocks x block_size).
The mask and indices are built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    inputs_embeds: torch.Tensor  # (T, hidden)
    positions: torch.Tensor  # (T,) int64, absolute position of each token (RoPE of q and k)
    sink_positions: torch.Tensor | None  # (T,) q position used against sink columns; None: same
    # (1, B, 1, n): which of the first n context columns are a rolling session's sink slots
    sink_cols: torch.Tensor | None
    slot_ids: torch.Tensor  # (T,) int64, KV slot each new token is written to
    block_ids: torch.Tensor  # (B, max_blocks) int64, gather order = logical order; pads masked
    padded_index: torch.Tensor | None  # (T,) row of each token in (B * Q); None when T == B * Q
    batch_size: int  # B
    max_chunk_tokens: int  # Q
    attend: torch.Tensor  # (1, B, 1, Q, C) bool, True where a query may see a key
    logits_index: torch.Tensor  # (R,) rows of T whose logits are wanted
