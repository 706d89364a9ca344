"""Kept for `tests/served.py` until it imports `metronome.bench.server`."""
