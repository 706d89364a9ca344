"""A client connection for tests that drive a `RealtimeSession` directly (no socket): the
session's events into a list (`serve.realtime.emitter.Client`)."""

from __future__ import annotations

from metronome.serve import protocol as p


class RecordingClient:
    def __init__(self, events: list[p.ServerEvent] | None = None) -> None:
        self.events: list[p.ServerEvent] = [] if events is None else events
        self.refused: list[p.ClientError] = []
        self.failures = 0

    def sink(self, event: p.ServerEvent, text: str, seq: int) -> None:
        self.events.append(event)

    def fail(self) -> None:
        self.failures += 1

    def refuse(self, error: p.ClientError) -> None:
        self.refused.append(error)
