"""Shared fixtures: a tiny random Llama for fast exact tests, and the bundled SmolLM2; the
`cluster` and `vllm` markers, given by folder (tests/cluster, tests/vllm)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# first of ours: under METRONOME_CPU=float32 it caps oneDNN before any torch work
from metronome.model import cpu  # noqa: F401
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import load_model, random_model

FOLDER_MARKERS = {"cluster": pytest.mark.cluster, "vllm": pytest.mark.vllm}


def pytest_collection_modifyitems(items) -> None:
    here = Path(__file__).parent
    for item in items:
        folder = Path(item.fspath).relative_to(here).parts[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return random_model(TINY_LLAMA, torch.float32, seed=1)


@pytest.fixture(scope="session")
def paged_kernel():
    """Call to get the compiled paged-attention kernel. Where it cannot be built the test
    fails with the reason, unless METRONOME_NATIVE_ATTENTION=0 says to go without it
    (then it skips): CI has a compiler, so a broken build must not pass as a skip."""
    def get():
        import os

        from metronome.model import native

        module = native.kernel()
        if module is None:
            if os.environ.get(native.DISABLE_ENV) == "0":
                pytest.skip(native.unavailable_reason())
            pytest.fail(f"paged kernel unavailable: {native.unavailable_reason()}")
        return module
    return get


@pytest.fixture(scope="session")
def smollm2():
    return load_model("bundled", torch.float32)
