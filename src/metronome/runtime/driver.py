"""What every driver shares: it owns the beat, runs engine steps, builds their reports and
applies the one idle rule. The wall and the virtual driver differ only in time: where a
step runs (an engine thread, or inline) and how long it takes (the wall clock, or a cost
model).

The idle rule: after a step in which no session processed any input (every session with
work was stalled on KV), nothing can change until the engine gets a command (a close frees
blocks, a submit brings input), so the driver steps again only after the next command.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from metronome.engine.types import PreparedInput, StepResult
from metronome.runtime.beat import Beat
from metronome.runtime.feed import FeedPolicy
from metronome.runtime.ports import (
    EngineCommands,
    EnginePort,
    Listeners,
    OverheadMeter,
    StepReport,
    Timer,
)


class EngineCommandsBase:
    """What every `EngineCommands` proxy does alike: ids and validation go straight to the
    engine (both are thread-safe); subclasses say how the other commands reach it."""

    def __init__(self, engine: EnginePort) -> None:
        self.engine = engine

    def new_session_id(self) -> int:
        return self.engine.new_session_id()

    def prepare_input(self, token_ids, embeddings) -> PreparedInput:
        return self.engine.prepare_input(token_ids, embeddings)


class Driver:
    def __init__(self, engine: EnginePort, commands: EngineCommands, timer: Timer,
                 listeners: Listeners) -> None:
        self.engine = engine
        self.listeners = listeners
        chunk_tokens = engine.config.max_chunk_tokens  # a session ahead: one step's chunk
        self.beat = Beat(commands, timer, listeners, FeedPolicy(
            ahead_tokens=chunk_tokens, free_engine_tokens=chunk_tokens,
            alone_engine_tokens=max(chunk_tokens, engine.config.max_prefill_chunk_tokens)))
        self.overhead = OverheadMeter()
        self._idle = False  # see the idle rule above

    @property
    def should_step(self) -> bool:
        return self.engine.has_work and not self._idle

    def on_command(self) -> None:
        """The engine got a command: the idle rule lets the next step run."""
        self._idle = False

    def run_step(self, started_s: float, finished_at: Callable[[StepResult], float]) -> StepReport:
        """One engine step and its report; `finished_at(result)` says when it ended."""
        t0 = time.perf_counter()
        result = self.engine.step()
        t1 = time.perf_counter()
        report = StepReport(result, started_s, finished_at(result), self.engine.pool_stats(),
                            self.engine.resident_tokens_by_session())
        self.overhead.engine_s += t1 - t0
        self.overhead.runtime_s += time.perf_counter() - t1
        self.overhead.steps += 1
        self._idle = result.num_input_tokens == 0
        return report

    def deliver(self, report: StepReport) -> None:
        """Hand a finished step to the beat (on the beat's thread): frames are answered,
        then the listeners hear of the step."""
        self.overhead.timed(lambda: self.beat.on_step(report))
