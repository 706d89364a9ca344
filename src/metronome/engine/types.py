"""What the engine reports: one step's output, the pool's occupancy, and the optional features
it serves."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

import torch

from metronome.kv.residency import ResidencyPolicy


class WorkStatus(enum.StrEnum):
    OK = "ok"  # the session's work for this step was done
    STALLED_KV = "stalled_kv"  # it needed KV blocks and the pool had none; retried next step
    CONTEXT_FULL = "context_full"  # it reached max_session_tokens; the session has ended


class EngineFeature(enum.StrEnum):
    """What an engine may serve beyond feeding and stepping sessions, declared on the port
    (`EnginePort.features`) so callers ask it instead of probing for methods. Each is a
    command of the beat (`runtime.beat`): an engine without one refuses it."""

    SESSION_POLICY = "session_policy"  # set_policy: a session's own bound, changed mid-session
    REPIN = "repin"  # repin: new instructions rewritten into the pinned prefix
    REWIND = "rewind"  # rewind_reply: a reply's unheard tokens taken out of the KV
    SNAPSHOT = "snapshot"  # snapshot_session / restore_session: a session moved between engines


@dataclass(frozen=True)
class Rebound:
    """A session's bound changed during a step, for `reason`:
    - "kv_pressure": an unbounded session switched to the engine's pressure bound, because
      the pool could not otherwise supply a session's blocks (`EngineConfig.pressure_policy`);
    - "position_limit": a bounded session with sinks reached the model's trained position
      range and goes on with rolling positions (`Session.roll`);
    - "pinned": its pinned prefix was rewritten with new instructions (`Engine.repin`)."""

    session_id: str
    policy: ResidencyPolicy
    freed_blocks: int  # blocks back in the pool at once
    resident_tokens: int  # its live KV afterwards
    reason: Literal["kv_pressure", "position_limit", "pinned"] = "kv_pressure"


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    pinned_blocks: int  # sink blocks of bounded sessions (a subset of used)


@dataclass
class StepOutput:
    """One engine step, by session id (each map holds the sessions it names, in step order):
    the engine fills the work, its driver the times and the readings after it."""

    status: dict[str, WorkStatus] = field(default_factory=dict)  # every session with work
    input_tokens: dict[str, int] = field(default_factory=dict)  # positions it processed
    consumed_tokens: dict[str, int] = field(default_factory=dict)  # of which fed input (its
    # last ones: a sampled token written back comes first)
    new_token_ids: dict[str, list[int]] = field(default_factory=dict)  # tokens it sampled
    generating: set[str] = field(default_factory=set)  # generation budget left after it
    context_tokens: dict[str, int] = field(default_factory=dict)  # keys its last position
    # attended to (the cost model's input)
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # (input_tokens, vocab)
    # float32, for sessions that asked (`SessionSpec.return_logits`)
    rebounds: list[Rebound] = field(default_factory=list)
    # ---- the driver's --------------------------------------------------------------------
    started_s: float = 0.0
    finished_s: float = 0.0
    pool: PoolStats | None = None  # after the step
    resident_tokens: dict[str, int] = field(default_factory=dict)  # live KV of every open
    # session after the step

    @property
    def num_input_tokens(self) -> int:
        return sum(self.input_tokens.values())

    @property
    def num_stalled(self) -> int:
        return sum(s is WorkStatus.STALLED_KV for s in self.status.values())

    @property
    def step_s(self) -> float:
        return self.finished_s - self.started_s
