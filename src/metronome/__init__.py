"""Metronome: real-time interaction model serving with bounded per-session KV."""
