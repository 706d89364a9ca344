"""Frames and frame results: one period's input, and the one result it always gets."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class FrameStatus(enum.StrEnum):
    OK = "ok"  # all of the frame's work was done within its deadline
    LATE = "late"  # the deadline passed first: what was ready went out at the deadline
    # The engine had no KV block: the result went out on the beat, without the work.
    # Today's engines do this silently; we always say why.
    STALLED_KV = "stalled_kv"
    CONTEXT_FULL = "context_full"  # the session reached max_session_tokens and ended
    REJECTED = "rejected"  # refused: the session has ended or the input was invalid
    # the session closed before the frame was answered, or its owner withdrew it (a reply
    # the user talked over)
    CANCELLED = "cancelled"


def count_input_tokens(token_ids: list[int] | torch.Tensor | None,
                       embeddings: torch.Tensor | None) -> int:
    """Input positions of token ids or (n, hidden) embeddings (one of them, or neither)."""
    if token_ids is not None:
        return len(token_ids)
    return 0 if embeddings is None else int(embeddings.shape[0])


@dataclass(eq=False)  # frames are compared by identity (they carry tensors)
class Frame:
    session_id: int
    index: int
    arrival_s: float  # when the frame was complete at the server
    token_ids: list[int] | torch.Tensor | None = None  # (n,) int64 when a tensor
    embeddings: torch.Tensor | None = None  # (n, hidden) from the audio front end
    respond: bool = True  # ask for output (duplex: every frame; turn: the turn's end)

    @property
    def num_input_tokens(self) -> int:
        return count_input_tokens(self.token_ids, self.embeddings)


@dataclass
class FrameResult:
    session_id: int
    index: int
    status: FrameStatus
    token_ids: list[int]
    arrival_s: float
    start_s: float | None  # when the engine first worked on it (None: never started)
    finish_s: float  # when the result was ready
    deadline_at_s: float
    expects_output: bool
    reason: str = ""
    late_token_ids: list[int] = field(default_factory=list)  # produced after it went out
    # The work the frame asked of its session: its own input, and its session's earlier
    # input still queued ahead of it when it went to the engine (answered frames' backlog).
    input_tokens: int = 0
    queued_ahead_tokens: int = 0

    @property
    def own_work_tokens(self) -> int:
        """Input the engine had to process for this session before this frame was done."""
        return self.input_tokens + self.queued_ahead_tokens

    @property
    def deadline_met(self) -> bool:
        # a late frame is answered *at* its deadline (on the virtual clock exactly), but its
        # work was not done: that is a miss
        return self.status is not FrameStatus.LATE and self.finish_s <= self.deadline_at_s

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def latency_fraction(self) -> float:
        """Latency as a share of the frame's deadline (the admission controller's signal)."""
        return self.latency_s / (self.deadline_at_s - self.arrival_s)

    @property
    def good(self) -> bool:
        """Goodput counts this frame: its work done, with output if output was asked for."""
        has_output = bool(self.token_ids) or not self.expects_output
        return self.status is FrameStatus.OK and self.deadline_met and has_output
