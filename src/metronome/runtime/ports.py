"""The seams of the runtime: the engine it drives, the timer it asks for deadlines and the
listeners it reports to.

`EnginePort` is the one interface an engine implements. The native `metronome.engine.Engine`
and `metronome.vllm.engine.VllmEngine` (vLLM + the sinks+window plugin) do; the beat, the
admission controller, the observer and the server need nothing else:

    check_input(ids, emb)      validate input, raise `SessionError` with the reason (pure, any
                               thread); the tensor it returns goes into the stream as is
    open_session(stream)       serve a `Stream` (its id, its spec; its input is read there);
                               raise `SessionError` for a spec the engine does not allow
    feed(id, n, max_new_tokens)
                               the stream's next n input positions are the engine's to
                               process, then up to max_new_tokens new tokens
    cancel_generation(id)      drop the rest of the budget (fed input is still processed)
    close(id)                  end the session; every one of its blocks goes back at once
    has_work / step()          one batched step over every session with work -> `StepOutput`
                               (per session: ok | stalled_kv | context_full, tokens, counts);
                               running out of KV is a status in the output, never an error
    pool_stats()               the block pool now (blocks used, free, pinned, block size)
    resident_tokens_by_session()
                               live KV tokens of every open session (the forecast's input)
    memory_ceiling(policy)     sessions under `policy` the pool holds at their peak (None:
                               unbounded): what admission never passes
    accepts_embeddings         whether input may be embeddings (an audio front end's)
    config                     an `EngineConfig` the server and observer size things by
    warm_up() / shutdown()     before the first user; when the server stops

Threading: a driver calls every method but `check_input` from one thread, never two at once
(the wall driver: its engine thread; the virtual driver: its only thread).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from metronome.engine.engine import EngineConfig
from metronome.engine.types import PoolStats, Rebound, StepOutput
from metronome.kv.residency import ResidencyPolicy
from metronome.stream import Frame, Stream


class EnginePort(Protocol):
    """The one seam an engine implements (see the module docstring)."""

    accepts_embeddings: bool
    config: EngineConfig

    def check_input(self, token_ids: list[int] | torch.Tensor | None,
                    embeddings: torch.Tensor | None) -> torch.Tensor | None: ...

    def open_session(self, stream: Stream) -> str: ...

    def feed(self, session_id: str, num_tokens: int, max_new_tokens: int = 0) -> None: ...

    def cancel_generation(self, session_id: str) -> None: ...

    def close(self, session_id: str) -> None: ...

    @property
    def has_work(self) -> bool: ...

    def step(self) -> StepOutput: ...

    def pool_stats(self) -> PoolStats: ...

    def resident_tokens_by_session(self) -> dict[str, int]: ...

    def memory_ceiling(self, policy: ResidencyPolicy) -> int | None: ...

    def warm_up(self) -> None: ...

    def shutdown(self) -> None: ...


class Timer(Protocol):
    def call_at(self, at_s: float, callback: Callable[[float], None]) -> None:
        """Run callback(now_s) at time at_s (or as soon after as possible)."""


def _ignore(_value) -> None:
    return None


@dataclass(frozen=True)
class Listeners:
    """Everything the runtime reports, given once, when a driver is built: each frame's
    result, each step, tokens that arrived after their frame had been answered, and sessions
    the engine bound under KV pressure."""

    on_result: Callable[[Frame], None] = _ignore
    on_step: Callable[[StepOutput], None] = _ignore
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
