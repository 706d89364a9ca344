"""A stream owner for tests that drive the beat directly: it records what the beat told it
(`metronome.stream.StreamOwner`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from metronome.engine.types import Rebound
from metronome.stream import Frame


@dataclass
class RecordingOwner:
    results: list[Frame] = field(default_factory=list)
    tokens: list[tuple[Frame, list[int]]] = field(default_factory=list)
    rebounds: list[Rebound] = field(default_factory=list)
    failures: int = 0

    def on_result(self, frame: Frame) -> None:
        self.results.append(frame)

    def on_tokens(self, frame: Frame, token_ids: list[int]) -> None:
        self.tokens.append((frame, token_ids))

    def on_rebound(self, rebound: Rebound) -> None:
        self.rebounds.append(rebound)

    def on_failure(self) -> None:
        self.failures += 1
