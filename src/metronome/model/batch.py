"""`ForwardBatch`: the tensors one batched forward needs, built by the engine each step.

T = valid tokens in the step (all sessions' chunks back to back). Attention runs on two
paths, each over a contiguous run of those rows:

* `PagedAttention` (rows [0, paged.num_tokens)): the compiled kernel reads each session's
  resident blocks in place; no padding, no mask tensor, visibility from positions.
* `DenseAttention` (the rest): the reference path. B = its sessions, Q = its longest chunk,
  C = gathered context slots per session (max blocks x block_size); every query is padded
  to Q and every session's blocks are copied into one (kvh, B, C, hd) scratch per layer.

Everything is built once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedAttention:
    num_tokens: int  # Tp: the step's first Tp rows
    token_session: torch.Tensor  # (Tp,) int64, index of the token's session in the tables
    token_positions: torch.Tensor  # (Tp,) int64, absolute position of each query
    token_window_start: torch.Tensor  # (Tp,) int64, ResidencyPolicy.window_start per query
    block_ids: torch.Tensor  # (Bp, max_blocks) int64, physical blocks in logical order
    block_logical: torch.Tensor  # (Bp, max_blocks) int64, their logical block numbers
    num_blocks: torch.Tensor  # (Bp,) int64, valid entries per row of the tables
    sink_tokens: torch.Tensor  # (Bp,) int64
    # (Bp,) int64: leading blocks scored against the rolling sink query (0: absolute positions)
    sink_blocks: torch.Tensor

    def __post_init__(self) -> None:
        # read by every layer: once here, not a tensor reduction per layer
        self.has_sink_blocks = bool(self.sink_blocks.any())

    def check(self, num_pool_blocks: int) -> None:
        """The index ranges the kernel trusts (it does no bounds checks of its own)."""
        sessions = self.block_ids.shape[0]
        assert self.token_session.shape == (self.num_tokens,)
        if self.num_tokens:
            assert 0 <= int(self.token_session.min()) and int(self.token_session.max()) < sessions
        if sessions:
            assert int(self.num_blocks.min()) >= 1
            assert int(self.num_blocks.max()) <= self.block_ids.shape[1]
            assert 0 <= int(self.block_ids.min()) and int(self.block_ids.max()) < num_pool_blocks


@dataclass
class DenseAttention:
    block_ids: torch.Tensor  # (B, max_blocks) int64, gather order = logical order; pads masked
    padded_index: torch.Tensor | None  # (Td,) row of each token in (B * Q); None when Td == B * Q
    batch_size: int  # B
    max_chunk_tokens: int  # Q
    attend: torch.Tensor  # (1, B, 1, Q, C) bool, True where a query may see a key
    # (1, B, 1, n): which of the first n context columns are a rolling session's sink slots
    sink_cols: torch.Tensor | None


@dataclass
class ForwardBatch:
    inputs_embeds: torch.Tensor  # (T, hidden)
    positions: torch.Tensor  # (T,) int64, absolute position of each token (RoPE of q and k)
    sink_positions: torch.Tensor | None  # (T,) q position used against sink columns; None: same
    slot_ids: torch.Tensor  # (T,) int64, KV slot each new token is written to
    logits_index: torch.Tensor  # (R,) rows of T whose logits are wanted
    paged: PagedAttention | None  # rows [0, paged.num_tokens)
    dense: DenseAttention | None  # the remaining rows
