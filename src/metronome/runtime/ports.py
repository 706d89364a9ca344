"""The seams of the runtime: the engine it drives, the timer it asks for deadlines, the
listeners it reports to, and what one engine step looks like to them.

`EnginePort` is the one interface an engine implements. The native `metronome.engine.Engine`
does; a second engine (vLLM, say) needs nothing else to run under the beat, the admission
controller, the observer and the server:

    new_session_id()           issue an id (thread-safe: the wall driver reserves ids on the
                               event loop and opens the session later on the engine thread)
    prepare_input(ids, emb)    validate input, raise `SessionError` with the reason (pure,
                               any thread); the result is submitted as is, never re-checked
    open_session(spec, id)     open under an issued id; raise `SessionError` for a policy
                               the engine does not allow
    submit_prepared(id, input, max_new_tokens)
                               queue input and a generation budget
    cancel_generation(id)      drop the rest of the budget (queued input is still processed)
    close(id)                  end the session; every one of its blocks goes back at once
    has_work / step()          one batched step over every session with work -> StepResult
                               (per session: ok | stalled_kv | context_full, tokens, counts);
                               running out of KV is a status in the result, never an error
    pool_stats()               the block pool now (blocks used, free, pinned, block size)
    resident_tokens_by_session()
                               live KV tokens of every open session (the forecast's input)
    memory_ceiling(policy)     sessions under `policy` the pool holds at their peak (None:
                               unbounded): what admission never passes
    accepts_embeddings         whether input may be embeddings (an audio front end's)
    config                     an `EngineConfig` the server and observer size things by
    warm_up() / shutdown()     before the first user; when the server stops

Two engines implement it: `metronome.engine.Engine` (native) and
`metronome.vllm.engine.VllmEngine` (vLLM + the sinks+window plugin).

Threading: a driver calls every method but the first two from one thread, never two at
once (the wall driver: its engine thread; the virtual driver: its only thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from metronome.engine.engine import EngineConfig
from metronome.engine.session import SessionSpec
from metronome.engine.types import PoolStats, PreparedInput, Rebound, StepResult
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.frame import FrameResult


class EngineCommands(Protocol):
    """What the beat asks of an engine: the session commands of `EnginePort`. A driver
    hands the beat either the engine itself or a proxy that applies each command later on
    the engine's thread."""

    def new_session_id(self) -> int: ...

    def prepare_input(self, token_ids: list[int] | torch.Tensor | None,
                      embeddings: torch.Tensor | None) -> PreparedInput: ...

    def open_session(self, spec: SessionSpec, session_id: int | None = None) -> int: ...

    def submit_prepared(self, session_id: int, prepared: PreparedInput,
                        max_new_tokens: int = 0) -> None: ...

    def cancel_generation(self, session_id: int) -> None: ...

    def close(self, session_id: int) -> None: ...


class EnginePort(EngineCommands, Protocol):
    """The one seam an engine implements (see the module docstring)."""

    @property
    def has_work(self) -> bool: ...

    def step(self) -> StepResult: ...

    def pool_stats(self) -> PoolStats: ...

    def resident_tokens_by_session(self) -> dict[int, int]: ...

    def memory_ceiling(self, policy: ResidencyPolicy) -> int | None: ...

    accepts_embeddings: bool
    config: EngineConfig

    def warm_up(self) -> None: ...

    def shutdown(self) -> None: ...


class Timer(Protocol):
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


def _ignore(_value) -> None:
    return None


@dataclass(frozen=True)
class Listeners:
    """Everything the runtime reports, given once, when a driver is built: each frame's
    result, each step, tokens that arrived after their frame had been answered, and sessions
    the engine bound under KV pressure."""

    on_result: Callable[[FrameResult], None] = _ignore
    on_step: Callable[[StepReport], None] = _ignore
    on_late_tokens: Callable[[int], None] = _ignore
    on_rebound: Callable[[Rebound], None] = _ignore

    @classmethod
    def of(cls, *listeners: object) -> Listeners:
        """Fan out to objects with any of `on_result`, `on_step`, `on_late_tokens`,
        `on_rebound` (a recorder, the observer, ...), called in the order given."""
        def fan(name: str):
            callbacks = [getattr(x, name) for x in listeners if hasattr(x, name)]
            if len(callbacks) == 1:
                return callbacks[0]

            def call(value) -> None:
                for callback in callbacks:
                    callback(value)
            return call if callbacks else _ignore

        return cls(fan("on_result"), fan("on_step"), fan("on_late_tokens"), fan("on_rebound"))


@dataclass
class OverheadMeter:
    """The runtime's own cost next to the engine's: report building, the beat's attribution,
    observers. Written from the engine thread and the loop without a lock: `+=` on a float
    is not atomic, so a rare update can be lost; fine for a share-of-time estimate."""

    engine_s: float = 0.0
    runtime_s: float = 0.0
    steps: int = 0

    def timed(self, fn: Callable[[], object]) -> None:
        """Run fn, counting its time as the runtime's."""
        started = time.perf_counter()
        fn()
        self.runtime_s += time.perf_counter() - started

    def summary(self) -> dict:
        share = self.runtime_s / self.engine_s if self.engine_s else None
        return {"steps": self.steps, "engine_step_s_total": self.engine_s,
                "runtime_s_total": self.runtime_s, "runtime_share_of_step": share}
