"""What the engine reports: per-session outcome of one step, and pool occupancy."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from metronome.kv.residency import ResidencyPolicy


class WorkStatus(enum.StrEnum):
    OK = "ok"  # the session's work for this step was done
    STALLED_KV = "stalled_kv"  # it needed KV blocks and the pool had none; retried next step
    CONTEXT_FULL = "context_full"  # it reached max_session_tokens; the session has ended


@dataclass(frozen=True)
class PreparedInput:
    """Input the engine has validated (`Engine.prepare_input`): submitted as is, never checked
    again. `data` is (n,) int64 token ids or (n, hidden) embeddings in the model's dtype."""

    data: torch.Tensor | None  # None: no input (a request for generation only)

    @property
    def num_tokens(self) -> int:
        return 0 if self.data is None else int(self.data.shape[0])


@dataclass
class SessionStep:
    session_id: int
    status: WorkStatus
    input_tokens: int = 0  # positions processed this step (caller input or fed-back tokens)
    submitted_tokens: int = 0  # of which caller-submitted input: the last ones (a session's
    # fed-back sampled token, when the step carries one, comes first)
    new_token_ids: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (input_tokens, vocab) float32 when asked for
    context_tokens: int = 0  # keys the chunk attended to at its last position (cost models)
    generating: bool = False  # generation budget left after this step


@dataclass(frozen=True)
class Rebound:
    """An unbounded session switched to the engine's pressure bound during a step, because
    the pool could not otherwise supply a session's blocks (`EngineConfig.pressure_policy`)."""

    session_id: int
    policy: ResidencyPolicy
    freed_blocks: int  # its middle blocks, back in the pool at once
    resident_tokens: int  # its live KV afterwards


@dataclass
class StepResult:
    sessions: list[SessionStep]
    rebounds: list[Rebound] = field(default_factory=list)

    @property
    def num_input_tokens(self) -> int:
        return sum(s.input_tokens for s in self.sessions)

    def by_session(self) -> dict[int, SessionStep]:
        return {s.session_id: s for s in self.sessions}


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    pinned_blocks: int  # sink blocks of bounded sessions (a subset of used)
