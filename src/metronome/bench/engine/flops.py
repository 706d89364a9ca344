"""Achieved FLOP/s of a step, and the plain `torch.matmul` reference over the same linear
shapes and weights (the linear-math floor a step is compared against)."""

from __future__ import annotations

import statistics

import torch

from metronome.bench.engine.timing import timed_call
from metronome.model.llama import LlamaModel


def linear_weights(model: LlamaModel) -> list[torch.Tensor]:
    """Every weight a decode step multiplies by, in order (lm_head last)."""
    weights = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return weights + [model.lm_head]


def step_flops(model: LlamaModel, sessions: int, attended_tokens: int) -> dict:
    """FLOPs of one decode step: linears (every row needs logits) and attention scores/values."""
    cfg = model.config
    linear = 2 * sessions * sum(w.numel() for w in linear_weights(model))
    attention = 2 * 2 * cfg.num_heads * cfg.head_dim * attended_tokens * sessions * cfg.num_layers
    return {"linear": linear, "attention": attention, "total": linear + attention}


def matmul_reference_ms(model: LlamaModel, sessions: int, repeats: int) -> float:
    """Median ms of plain `torch.matmul(x, W.T)` over the step's linear shapes, same weights."""
    gen = torch.Generator().manual_seed(4)
    inputs = {n: torch.randn(sessions, n, generator=gen).to(model.dtype)
              for n in {w.shape[1] for w in linear_weights(model)}}

    def all_linears() -> None:
        for w in linear_weights(model):
            torch.matmul(inputs[w.shape[1]], w.t())

    with torch.inference_mode():
        all_linears()  # warm-up
        return statistics.median(timed_call(all_linears)[0] for _ in range(max(repeats, 3)))


def add_flops(row: dict, model: LlamaModel, sessions: int, matmul_ref_ms: float) -> None:
    """FLOPs, tokens/s and achieved FLOP/s of a measured row, against the matmul reference."""
    flops = step_flops(model, sessions, row["attended_tokens"])
    row["flops"] = flops
    row["tokens_per_s"] = sessions / (row["step_ms_median"] / 1e3)
    row["achieved_flops_per_s"] = flops["total"] / (row["step_ms_median"] / 1e3)
    row["matmul_ref_ms"] = matmul_ref_ms
    row["matmul_ref_flops_per_s"] = flops["linear"] / (matmul_ref_ms / 1e3)
    row["achieved_over_matmul_ref"] = row["achieved_flops_per_s"] / row["matmul_ref_flops_per_s"]
