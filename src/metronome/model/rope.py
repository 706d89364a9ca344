"""Rotary position embedding (Hugging Face "rotate half" layout).

Angles are formed in float64 so that a key at absolute position 10^6 rotates as exactly
as one at position 10: rolling positions rely on RoPE depending only on `p_q - p_k`.
"""

from __future__ import annotations

import torch


def inv_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    # Same float32 recipe as transformers' default RoPE, so logits match it bit-for-bit-ish.
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: (T,) int64 -> cos, sin: (T, 1, head_dim), broadcast over heads."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
