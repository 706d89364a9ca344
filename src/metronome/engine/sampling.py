"""Per-session token choice: greedy (the engine's batched argmax), or seeded temperature +
top-p (here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def greedy_ids(logits: torch.Tensor, fused=None) -> list[int]:
    """Each row's greedy token: the first index of its maximum (a NaN counts as the
    maximum), as `torch.argmax(dim=-1)` gives it. `fused`: the model's fused kernels
    (`native.fused_ops()`), whose `argmax_rows` reads a row 8 values at a time where torch
    walks it one by one (a decode step's 8 x 49,152 logits: 0.35 ms with torch on a Zen
    1-class EPYC); None, or logits it does not take, and torch answers."""
    if len(logits) == 0:
        return []
    if (fused is not None and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.is_contiguous() and logits.shape[1] > 0):
        return fused.argmax_rows(logits).tolist()
    return logits.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Seeded temperature + top-p draw: logits (vocab,) float32 -> one token id. Greedy
    sessions never come here: the engine takes one batched argmax over the step."""
    assert not params.greedy, "greedy decoding is the engine's batched argmax"
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
