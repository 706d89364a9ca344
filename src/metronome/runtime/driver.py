"""The step loop every driver shares: it owns the beat, runs engine steps, completes their
outputs (times, pool, resident KV) and applies the one idle rule. The wall and the virtual
driver differ only in time: where a step runs (an engine thread, or inline) and how long it
takes (the wall clock, or a cost model); each gives the beat its way to run an engine
command (`run_on_engine`) and to ask the engine a question (`ask_engine`).

The idle rule: after a step in which no session processed any input (every session with
work was stalled on KV), nothing can change until the engine gets a command (a close frees
blocks, a feed brings input), so the driver steps again only after the next command.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from metronome.engine.types import StepOutput
from metronome.runtime.beat import Beat
from metronome.runtime.ports import AskEngine, EnginePort, Listeners, RunOnEngine, Timer


@dataclass
class OverheadMeter:
    """The runtime's own cost next to the engine's: output completion, the beat's
    attribution, observers. Written from the engine thread and the loop without a lock:
    `+=` on a float is not atomic, so a rare update can be lost; fine for a share of time."""

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


class Driver:
    def __init__(self, engine: EnginePort, run_on_engine: RunOnEngine, ask_engine: AskEngine,
                 timer: Timer, listeners: Listeners) -> None:
        self.engine = engine
        self.listeners = listeners
        self.beat = Beat(engine, run_on_engine, ask_engine, timer, listeners)
        self.overhead = OverheadMeter()
        self._idle = False  # see the idle rule above

    @property
    def should_step(self) -> bool:
        return self.engine.has_work and not self._idle

    def on_command(self) -> None:
        """The engine got a command: the idle rule lets the next step run."""
        self._idle = False

    def run_step(self, started_s: float, finished_at: Callable[[StepOutput], float]
                 ) -> StepOutput:
        """One engine step, its output completed; `finished_at(out)` says when it ended."""
        t0 = time.perf_counter()
        out = self.engine.step()
        t1 = time.perf_counter()
        out.started_s, out.finished_s = started_s, finished_at(out)
        out.pool = self.engine.pool_stats()
        out.resident_tokens = self.engine.resident_tokens_by_session()
        self.overhead.engine_s += t1 - t0
        self.overhead.runtime_s += time.perf_counter() - t1
        self.overhead.steps += 1
        self._idle = out.num_input_tokens == 0
        return out

    def deliver(self, out: StepOutput) -> None:
        """Hand a finished step to the beat (on the beat's thread): frames are answered,
        then the listeners hear of the step."""
        self.overhead.timed(lambda: self.beat.on_step(out))
