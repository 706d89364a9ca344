"""Session profile: a session as a periodic real-time task."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from metronome.engine.sampling import SamplingParams
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.workload_defaults import (
    DEADLINE_FRACTION,
    FRAME_PERIOD_S,
    OUTPUT_TOKENS_PER_FRAME,
    POLICY_SPEC,
)


class SessionMode(enum.StrEnum):
    """When a session generates: the server's `session.metronome.mode` and the runtime's."""

    DUPLEX = "duplex"  # every frame gets output, no turns (Moshi, MiniCPM-o)
    TURN = "turn"  # input is prefilled as it arrives; output only when a frame asks for it


@dataclass(frozen=True)
class SessionProfile:
    frame_period_s: float = FRAME_PERIOD_S
    # deadline = fraction x period after the frame arrives
    deadline_fraction: float = DEADLINE_FRACTION
    max_output_tokens_per_frame: int = OUTPUT_TOKENS_PER_FRAME
    mode: SessionMode = SessionMode.DUPLEX
    policy: ResidencyPolicy = ResidencyPolicy.parse(POLICY_SPEC)
    sampling: SamplingParams = SamplingParams()
    max_session_tokens: int | None = None
    # Input accepted but not yet processed (the backlog of answered frames included) that
    # the session may have queued; a frame that would exceed it is rejected (None: no bound).
    max_queued_input_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 0.01 <= self.frame_period_s <= 60:
            raise ValueError(f"frame_period_s must be in [0.01, 60], got {self.frame_period_s}")
        if not 0 < self.deadline_fraction <= 10:
            raise ValueError(f"deadline_fraction must be in (0, 10], got {self.deadline_fraction}")
        if self.max_output_tokens_per_frame < 0:
            raise ValueError(f"max_output_tokens_per_frame must be >= 0, got "
                             f"{self.max_output_tokens_per_frame}")
        if self.max_queued_input_tokens is not None and self.max_queued_input_tokens < 1:
            raise ValueError(f"max_queued_input_tokens must be >= 1, got "
                             f"{self.max_queued_input_tokens}")

    @property
    def spec(self) -> SessionSpec:
        """What the engine serves a session of this profile with."""
        return SessionSpec(policy=self.policy, sampling=self.sampling,
                           max_session_tokens=self.max_session_tokens)

    @property
    def deadline_s(self) -> float:
        return self.frame_period_s * self.deadline_fraction

    def output_tokens_for(self, respond: bool) -> int:
        if self.mode is SessionMode.DUPLEX or respond:
            return self.max_output_tokens_per_frame
        return 0
