"""The model's projections: oneDNN matrix products on weights reordered ("prepacked") once.

torch's `F.linear` hands the weight to BLAS as it lies, and BLAS re-blocks it on every call;
for the few-row products of a decode step that re-blocking is a large share of the time.
oneDNN's linear with a weight reordered once into its own blocked layout skips it: 1.3-2x
faster per projection on this project's CPU machines, for the same products within float
rounding. With at most `small_rows_max(dtype)` rows the product runs on the plain weight in
`native.small_linear` instead, in bf16 on an AVX512-BF16 CPU and in float32 on an AVX2 one
with FMA (a decode step of a few sessions is a pass over the weights: 1.2-1.5x faster than
oneDNN's there in bf16 at 1-8 rows, no faster from 16; in float32 on an AVX2 Zen 3 1.2-1.4x
at 1-16 rows, 1.17x at 24, the same at 32; on a Zen 1-class core up to 64 rows, below).
In bf16 that kernel reads its own copy of the weight, packed once here (`pack_bf16`: pairs
of rows as runs of memory, which the memory streams 1.1-1.2x faster at 8 rows): one more
copy of the weights in memory, as the oneDNN one is (the plain weight stays the reference's
and the model's).
`Projection` is the one place that choice is made; `F.linear` on the plain weight
(`packed=False`) stays as the reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from metronome.model.cpu import cpuinfo_field, proc_lines
from metronome.model.spans import in_span

# oneDNN picks its blocking for this many rows; any row count works (measured: 64 is best
# from 1 to 256 rows for SmolLM2's shapes; a 1-row hint is 1.3x slower at 8-64 rows).
PACK_ROWS_HINT = 64
# rows up to which a packed projection runs `native.small_linear`, per dtype (where the
# kernel measured faster than oneDNN, the model's projections from memory side by side)
SMALL_ROWS_MAX = {torch.bfloat16: 8, torch.float32: 24}
# ... in float32 on a core that runs a 256-bit FMA as two 128-bit halves (AMD Zen 1 and Zen+:
# family 23, models below 0x30). There the kernel is at the core's peak from 24 rows (61-65
# GFLOP/s on a ~2 GHz Zen 1-class EPYC, 2 threads) while oneDNN gets 46-58 at 24-64 rows:
# the kernel 1.03-1.29x faster at 32-56 rows, 1.05-1.12x at 64, 1.00-1.02x at 80, slower
# from 96 (`scripts/few_rows.py`, docs/results/zen1_float32_step.md).
SPLIT_FMA_FLOAT32_ROWS_MAX = 64
SMALL_LINEAR_EVENT = "metronome::small_linear"  # its span under torch.profiler (not an aten op)


@functools.cache
def split_fma() -> bool:
    """Does this CPU split a 256-bit FMA in two 128-bit halves (`splits_fma` of its
    /proc/cpuinfo; False where there is none)?"""
    return splits_fma(proc_lines("/proc/cpuinfo"))


def splits_fma(cpuinfo: list[str]) -> bool:
    """Its CPU is an AMD family 23 before model 0x30 (Zen 1, Zen+; Zen 2 is 0x30 on), by the
    first value of each field."""
    vendor, family, model = (cpuinfo_field(cpuinfo, name)
                             for name in ("vendor_id", "cpu family", "model"))
    try:
        return vendor == "AuthenticAMD" and int(family) == 23 and int(model) < 0x30
    except (TypeError, ValueError):  # a field missing or not a number
        return False


def small_rows_max(dtype: torch.dtype) -> int:
    """Rows up to which a packed projection of this dtype runs the few-row kernel (0: none)."""
    if dtype == torch.float32 and split_fma():
        return SPLIT_FMA_FLOAT32_ROWS_MAX
    return SMALL_ROWS_MAX.get(dtype, 0)


def packing_supported(dtype: torch.dtype) -> bool:
    """Prepacked oneDNN linears for this dtype on this machine: float32 wherever oneDNN is
    built in, bfloat16 only with native bf16 instructions (oneDNN emulates it otherwise)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        from metronome.model.dtypes import native_bf16

        return native_bf16()
    return False


class Projection:
    """y = x @ weight.T (+ bias) for 2-D x: prepacked oneDNN, or `F.linear` as reference."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool,
                 few_rows: bool = True) -> None:
        """`packed`: oneDNN on prepacked weights (else `F.linear`, the reference); with it,
        `few_rows`: the few-row kernel where it applies (False: oneDNN at every row count)."""
        self.weight, self.bias = weight, bias
        self.packed = None
        self.small = None  # the few-row kernel module, where it applies
        self.small_weight = weight  # what it reads: bf16 packs a copy for it
        self.out_features = weight.shape[0]
        if packed:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                                   PACK_ROWS_HINT)
            self.small_rows_max = small_rows_max(weight.dtype)
            if few_rows and weight.is_contiguous() and (
                    bias is None or bias.dtype == weight.dtype and bias.is_contiguous()):
                from metronome.model import native

                self.small = native.small_linear(weight.dtype)
                if self.small is not None and weight.dtype == torch.bfloat16:
                    self.small_weight = self.small.pack_bf16(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.shape[0] == 0:
            return F.linear(x, self.weight, self.bias)
        if (self.small is not None and x.shape[0] <= self.small_rows_max and x.is_contiguous()
                and x.dtype == self.weight.dtype):
            return in_span(SMALL_LINEAR_EVENT, self.small.small_linear, x, self.small_weight,
                           self.bias, self.out_features)
        return self.onednn(x)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """The prepacked oneDNN product, whatever the row count."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
