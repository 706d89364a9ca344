"""Shared fixtures: a tiny random Llama for fast exact tests, and the bundled SmolLM2."""

from __future__ import annotations

import pytest
import torch

from metronome.model.config import TINY_LLAMA
from metronome.model.weights import load_model, random_model


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return random_model(TINY_LLAMA, torch.float32, seed=1)


@pytest.fixture(scope="session")
def smollm2():
    return load_model("bundled", torch.float32)
