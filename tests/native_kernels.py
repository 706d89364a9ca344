"""The native kernels' test modules load the ones that need particular instructions through
these helpers (AVX512-BF16 for bf16, AVX2 with FMA for the float32 few-row kernel)."""

from __future__ import annotations

import os

import pytest


def _kernel(extension, what: str, available: str, isa: str, without: str):
    """`extension`'s module; the test is skipped when native kernels are disabled or the
    module's `available` check says the CPU lacks `isa` (`without` says what runs instead),
    and fails when the kernel does not build."""
    from metronome.model import native

    module = extension.module()
    if module is None:
        if os.environ.get(native.DISABLE_ENV) == "0":
            pytest.skip(extension.reason())
        pytest.fail(f"the {what} did not build: {extension.reason()}")
    if not getattr(module, available)():
        from metronome.model import cpu

        pytest.skip(f"{cpu.lacks(isa)}: {without}")
    return module


def bf16_kernel(extension, what: str, without_bf16: str):
    """`extension`'s bf16 kernel (its `available()`), on AVX512-BF16 CPUs."""
    return _kernel(extension, what, "available", "AVX512-BF16", without_bf16)


def float32_kernel(extension, what: str, without: str):
    """`extension`'s float32 kernel (its `float32_available()`), on AVX2 CPUs with FMA."""
    return _kernel(extension, what, "float32_available", "AVX2 with FMA", without)
