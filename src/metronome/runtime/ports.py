"""The narrow interfaces between the beat (runtime core) and what drives it.

The core never touches the engine or a clock directly: it sends commands through an
`EnginePort` and asks a `Scheduler` for deadline callbacks. The wall-clock driver backs
them with an engine thread and the event loop; the virtual driver with direct calls and
an event heap. Same core, two clocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from metronome.engine.session import SessionSpec
from metronome.engine.types import PoolStats, StepResult


class EnginePort(Protocol):
    def validate(self, token_ids: list[int] | None, embeddings: torch.Tensor | None) -> None:
        """Raise ValueError for input the engine would refuse (pure: any thread)."""

    def open(self, session_id: int, spec: SessionSpec) -> None: ...

    def submit(
        self, session_id: int, token_ids: list[int] | None, embeddings: torch.Tensor | None,
        max_new_tokens: int,
    ) -> None: ...

    def cancel(self, session_id: int) -> None: ...

    def close(self, session_id: int) -> None: ...


class Scheduler(Protocol):
    def call_at(self, at_s: float, callback: Callable[[float], None]) -> None:
        """Run callback(now_s) at time at_s (or as soon after as possible)."""


@dataclass
class StepReport:
    """One engine step as the runtime sees it: outcome, timing, pool afterwards."""

    result: StepResult
    started_s: float
    finished_s: float
    pool: PoolStats
    resident_tokens: dict[int, int]  # live KV tokens of every open session after the step

    @property
    def step_s(self) -> float:
        return self.finished_s - self.started_s


@dataclass
class OverheadMeter:
    """The runtime's own cost next to the engine's: report building, the beat's attribution,
    observers. Written from the engine thread and the loop without a lock: `+=` on a float
    is not atomic, so a rare update can be lost; fine for a share-of-time estimate."""

    engine_s: float = 0.0
    runtime_s: float = 0.0
    steps: int = 0

    def summary(self) -> dict:
        share = self.runtime_s / self.engine_s if self.engine_s else None
        return {"steps": self.steps, "engine_step_s_total": self.engine_s,
                "runtime_s_total": self.runtime_s, "runtime_share_of_step": share}
