"""The dtypes a model is served in, and what `auto` resolves to on this CPU."""

from __future__ import annotations

import torch

from metronome.model import cpu

# the dtypes a model can be served in, by the names the command line and configs use
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# ... plus "auto" (the default): bfloat16 where the CPU computes it natively (AVX512-BF16 or
# AMX), else float32. Measured: on a Xeon with native bf16, bf16 steps were 1.5-2x faster
# than fp32; on an AMD EPYC without it, an 8-session prefill step of SmolLM2 took 1,097 ms
# in bf16 against 221 ms in fp32 (docs/results/engine.md).
AUTO_DTYPE = "auto"
DTYPE_NAMES = (AUTO_DTYPE, *DTYPES)


def native_bf16() -> bool:
    """Does this CPU compute bf16 matmuls natively (not by conversion)? No where a float32
    host is forced (`METRONOME_CPU=float32`, `metronome.model.cpu`)."""
    return cpu.native_bf16()


def resolve_dtype(name: str) -> torch.dtype:
    """A dtype name of `DTYPE_NAMES` -> the torch dtype to serve in."""
    if name == AUTO_DTYPE:
        return torch.bfloat16 if native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return DTYPES[name]
