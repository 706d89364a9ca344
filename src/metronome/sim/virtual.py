"""Virtual-clock driver: deterministic discrete-event time, real engine steps.

The engine really runs every step (real tokens, real KV pool); only time is virtual:
each step takes what the `StepCostModel` says. Runs much faster than real time and gives
the same answer every run, for tests and experiments. The beat, the step report and the
idle rule are the same code as on the wall clock (`runtime.driver`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from metronome.engine.types import StepOutput
from metronome.runtime.driver import Driver
from metronome.runtime.ports import EnginePort, Listeners
from metronome.sim.cost_model import StepCostModel


class EventHeap:
    """The virtual clock: a `Timer` whose callbacks run in time order, ties in call order."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()

    def call_at(self, at_s: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (max(at_s, self.now_s), next(self._seq), callback))

    def next_time_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run_next(self) -> None:
        at_s, _, callback = heapq.heappop(self._heap)
        self.now_s = at_s
        callback(at_s)


T = TypeVar("T")


class Answered(Generic[T]):
    """An engine question's answer, known at once (this driver runs the engine inline): an
    `Answer` whose callbacks run when they are added."""

    def __init__(self, question: Callable[[], T]) -> None:
        self._value: T | None = None
        self._error: Exception | None = None
        try:
            self._value = question()
        except Exception as err:  # the asker's, as a future would hold it
            self._error = err

    def add_done_callback(self, fn: Callable[[Any], object], /) -> None:
        fn(self)

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> T:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]  # set when no error was

    def __await__(self) -> Generator[Any, None, T]:
        return self.result()
        yield  # a generator that never suspends


class VirtualDriver(Driver):
    def __init__(self, engine: EnginePort, cost_model: StepCostModel,
                 listeners: Listeners) -> None:
        self.cost_model = cost_model
        self.clock = EventHeap()
        super().__init__(engine, self._run_now, self._ask_now, self.clock, listeners)
        self._busy = False  # a step has started and its end is on the clock

    @property
    def now_s(self) -> float:
        return self.clock.now_s

    def _run_now(self, command) -> None:
        """An engine command, applied at once (this driver owns the only thread)."""
        self.on_command()
        command()

    def _ask_now(self, question: Callable[[], T]) -> Answered[T]:
        """An engine question, answered at once."""
        self.on_command()
        return Answered(question)

    def run_until(self, until_s: float) -> None:
        """Advance virtual time to `until_s`, stepping the engine whenever it may."""
        while True:
            if not self._busy and self.should_step:
                self._start_step()
            next_s = self.clock.next_time_s()
            if next_s is None or next_s > until_s:
                break
            self.clock.run_next()
        self.clock.now_s = max(self.clock.now_s, until_s)

    def _start_step(self) -> None:
        started_s = self.clock.now_s
        out = self.run_step(started_s, lambda out: started_s + self.cost_model.step_s(out))
        self._busy = True
        self.clock.call_at(out.finished_s, lambda _t: self._finish_step(out))

    def _finish_step(self, out: StepOutput) -> None:
        self._busy = False
        self.deliver(out)
