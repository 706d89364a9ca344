"""Fixtures shared by the server tests."""

from __future__ import annotations

import pytest

from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.server import ServerThread


@pytest.fixture(scope="module")
def turn_server(smollm2):
    """The bundled model in turn mode (`metronome serve --mode turn`): a reply per
    `response.create`, as the voice-agent frameworks expect (duplex answers every frame with
    its few tokens)."""
    config = ServerConfig(pool_tokens=4096, admission="off", deadline_fraction=2.0, mode="turn")
    with ServerThread(config, smollm2, load_tokenizer()) as running:
        yield running
