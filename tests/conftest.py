"""Shared fixtures: a tiny random Llama for fast exact tests, and the bundled SmolLM2."""

from __future__ import annotations

import pytest
import torch

from metronome.model.config import ModelConfig
from metronome.model.weights import load_model, random_model

TINY = ModelConfig(
    name="tiny", arch="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return random_model(TINY, torch.float32, seed=1)


@pytest.fixture(scope="session")
def smollm2():
    return load_model("bundled", torch.float32)
