"""Kept for `tests/served.py` until it imports `metronome.bench.server`."""

from metronome.bench.server import free_port, healthy  # noqa: F401
