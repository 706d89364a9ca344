"""The seams of the runtime: the engine it drives, the thread its commands run on, the timer it
asks for deadlines and the listeners it reports to.

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
    model                      the native model (its token embeddings size an audio front
                               end); None for an engine without one (vLLM)
    config                     an `EngineConfig` the server and observer size things by
    warm_up() / shutdown()     before the first user; when the server stops

and the optional features (`features`, a set of `EngineFeature`; an engine without one
raises `SessionError` for its command, and callers ask `features` first, never `hasattr`):

    set_policy(id, policy)     SESSION_POLICY: the session's own bound from now on
    repin(id, ids)             REPIN: new instructions as the pinned prefix
    rewind_reply(id, keep)     REWIND: all but `keep` tokens of the latest reply out of the KV
    snapshot_session(id) / restore_session(snapshot, stream)
                               SNAPSHOT: a bounded session's whole state, and back

Each is a command of the beat (`Beat.set_policy`, `repin`, `rewind_reply`, `snapshot`,
`restore`), so it runs on the engine thread in order with the session's input.

Threading: a driver calls every method but `check_input` from one thread, never two at once
(the wall driver: its engine thread; the virtual driver: its only thread). The beat hands it
commands (`RunOnEngine`) and questions (`AskEngine`, whose `Answer` comes back on the beat's
thread).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from metronome.engine.engine import EngineConfig
from metronome.engine.snapshot import SessionSnapshot
from metronome.engine.types import EngineFeature, PoolStats, Rebound, StepOutput
from metronome.kv.residency import ResidencyPolicy
from metronome.model.llama import LlamaModel
from metronome.stream import Frame, Stream

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class EnginePort(Protocol):
    """The one seam an engine implements (see the module docstring)."""

    @property
    def accepts_embeddings(self) -> bool: ...

    @property
    def features(self) -> frozenset[EngineFeature]: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def model(self) -> LlamaModel | None: ...

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

    # ---- the optional features (`features`) ---------------------------------------------------
    def set_policy(self, session_id: str, policy: ResidencyPolicy) -> int: ...

    def repin(self, session_id: str, token_ids: list[int] | torch.Tensor) -> bool: ...

    def rewind_reply(self, session_id: str, keep_tokens: int) -> int: ...

    def snapshot_session(self, session_id: str) -> SessionSnapshot: ...

    def restore_session(self, snapshot: SessionSnapshot, stream: Stream) -> bool: ...


RunOnEngine = Callable[[Callable[[], object]], None]  # a command, in order, between steps


class Answer(Protocol[T_co]):
    """What an engine question (`AskEngine`) returns: its result or its exception, delivered
    on the beat's thread (the wall driver: an asyncio future resolved on the loop; the
    virtual driver: resolved at once)."""

    def add_done_callback(self, fn: Callable[[Any], object], /) -> None: ...

    def cancelled(self) -> bool: ...

    def exception(self) -> BaseException | None: ...

    def result(self) -> T_co: ...

    def __await__(self) -> Generator[Any, None, T_co]: ...


class AskEngine(Protocol):
    def __call__(self, question: Callable[[], T], /) -> Answer[T]:
        """Run `question` on the engine thread, in order with the commands, between steps."""


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

    on_result: Callable[[Frame[Any]], None] = _ignore
    on_step: Callable[[StepOutput], None] = _ignore
    on_late_tokens: Callable[[int], None] = _ignore
    on_rebound: Callable[[Rebound], None] = _ignore

    @classmethod
    def of(cls, *listeners: object) -> Listeners:
        """Fan out to objects with any of `on_result`, `on_step`, `on_late_tokens`,
        `on_rebound` (a recorder, the observer, ...), called in the order given."""
        def fan(name: str):
            callbacks = [c for x in listeners if (c := getattr(x, name, None)) is not None]
            if len(callbacks) == 1:
                return callbacks[0]

            def call(value) -> None:
                for callback in callbacks:
                    callback(value)
            return call if callbacks else _ignore

        return cls(fan("on_result"), fan("on_step"), fan("on_late_tokens"), fan("on_rebound"))
