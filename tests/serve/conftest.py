"""Fixtures shared by the server tests."""

from __future__ import annotations

import pytest

from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.server import ServerThread
from tests.host_speed import UNHURRIED_DEADLINE_FRACTION
from tests.served import TEXT_SERVER


@pytest.fixture(scope="module")
def turn_server(smollm2):
    """The bundled model in turn mode (`metronome serve --mode turn`): a reply per
    `response.create`, as the voice-agent frameworks expect (duplex answers every frame with
    its few tokens). Unhurried: these suites check what the clients see of an answer, and a
    late one would be cut short (`incomplete`) on a slow host."""
    config = ServerConfig(**TEXT_SERVER, pool_tokens=4096, admission="off", mode="turn",
                          deadline_fraction=UNHURRIED_DEADLINE_FRACTION)
    with ServerThread(config, smollm2, load_tokenizer()) as running:
        yield running
