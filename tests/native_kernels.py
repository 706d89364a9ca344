"""The AVX512-BF16 kernels' test modules load them through one helper."""

from __future__ import annotations

import os

import pytest


def bf16_kernel(extension, what: str, without_bf16: str):
    """`extension`'s module; the test is skipped when native kernels are disabled or the CPU
    has no AVX512-BF16 (`without_bf16` says what runs instead), and fails when the kernel
    does not build."""
    from metronome.model import native

    module = extension.module()
    if module is None:
        if os.environ.get(native.DISABLE_ENV) == "0":
            pytest.skip(extension.reason())
        pytest.fail(f"the {what} did not build: {extension.reason()}")
    if not module.available():
        pytest.skip(f"this CPU has no AVX512-BF16: {without_bf16}")
    return module
