"""What a bench ran on, as its result records it: the model, the dtype as resolved, and the
engine path as it ran (the fast path falls back where a kernel cannot be built)."""

from __future__ import annotations

import torch

from metronome.model.llama import LlamaModel
from metronome.model.weights import BUNDLED_NAME

BUNDLED_MODEL = f"{BUNDLED_NAME} (bundled)"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def engine_path(path: str, model: LlamaModel) -> str:
    """`path` ("fast", "reference", or a bench's own name for a variant of the fast one) and
    what it ran with on this machine and `model`."""
    from metronome.model import native

    if path == "reference":
        return "reference (dense attention, F.linear)"
    paged = native.kernel() is not None
    attention = "paged kernel" if paged else f"dense attention: {native.unavailable_reason()}"
    if paged and model.dtype == torch.bfloat16:
        attention += (", long chunks: prefill kernel" if model.prefill is not None
                      else ", long chunks: torch's SDPA")
    linear = "prepacked oneDNN projections" if model.packed_linear else "F.linear"
    if model.packed_linear and model.lm_head_projection.small is not None:
        from metronome.model.linear import small_rows_max

        linear += f" (few-row kernel up to {small_rows_max(model.dtype)} rows)"
    elementwise = ("fused elementwise kernels" if model.fused is not None
                   else f"torch's elementwise ops ({native.FUSED.reason() or 'turned off'})")
    return f"{path} ({attention}, {linear}, {elementwise})"
