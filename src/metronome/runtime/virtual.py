"""Virtual-clock driver: deterministic discrete-event time, real engine steps.

The engine really runs every step (real tokens, real KV pool); only time is virtual:
each step takes what the `StepCostModel` says. Runs much faster than real time and gives
the same answer every run, for tests and experiments. The beat is the same code as on the
wall clock.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable

import torch

from metronome.engine.engine import Engine
from metronome.engine.session import SessionSpec
from metronome.runtime.beat import Beat
from metronome.runtime.cost_model import StepCostModel
from metronome.runtime.frame import FrameResult
from metronome.runtime.ports import OverheadMeter, StepReport


class DirectEnginePort:
    """Engine commands applied at once (the virtual driver owns the only thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def validate(self, token_ids, embeddings) -> None:
        self.engine.check_input(token_ids, embeddings)

    def open(self, session_id: int, spec: SessionSpec) -> None:
        self.engine.open_session(spec, session_id=session_id)

    def submit(self, session_id, token_ids, embeddings: torch.Tensor | None, max_new_tokens):
        self.engine.submit(session_id, token_ids, embeddings, max_new_tokens)

    def cancel(self, session_id: int) -> None:
        self.engine.cancel_generation(session_id)

    def close(self, session_id: int) -> None:
        self.engine.close(session_id)


class EventHeap:
    def __init__(self) -> None:
        self.now_s = 0.0
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()  # ties run in scheduling order

    def call_at(self, at_s: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (max(at_s, self.now_s), next(self._seq), callback))

    def next_time_s(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run_next(self) -> None:
        at_s, _, callback = heapq.heappop(self._heap)
        self.now_s = at_s
        callback(at_s)


class VirtualDriver:
    def __init__(
        self,
        engine: Engine,
        cost_model: StepCostModel,
        on_result: Callable[[FrameResult], None],
        on_step: Callable[[StepReport], None] | None = None,
    ) -> None:
        self.engine = engine
        self.cost_model = cost_model
        self.clock = EventHeap()
        self.beat = Beat(DirectEnginePort(engine), self.clock, on_result, on_step)
        self._busy = False
        # After a step in which no session could work (all stalled on KV), nothing can
        # change until some event happens (a close, a new frame): wait for one.
        self._idle_until_event = False
        self.overhead = OverheadMeter()

    @property
    def now_s(self) -> float:
        return self.clock.now_s

    def run_until(self, until_s: float) -> None:
        """Advance virtual time to `until_s`, stepping the engine whenever it has work."""
        while True:
            if not self._busy and not self._idle_until_event and self.engine.has_work:
                self._start_step()
            next_s = self.clock.next_time_s()
            if next_s is None or next_s > until_s:
                break
            self.clock.run_next()
            self._idle_until_event = self._idle_until_event and self._busy
        self.clock.now_s = max(self.clock.now_s, until_s)

    def _start_step(self) -> None:
        started_s = self.clock.now_s
        t0 = time.perf_counter()
        result = self.engine.step()
        t1 = time.perf_counter()
        finished_s = started_s + self.cost_model.step_s(result)
        report = StepReport(
            result, started_s, finished_s, self.engine.pool_stats(),
            {sid: self.engine.resident_tokens(sid) for sid in self.engine.sessions},
        )
        self.overhead.engine_s += t1 - t0
        self.overhead.runtime_s += time.perf_counter() - t1
        self.overhead.steps += 1
        self._busy = True
        self.clock.call_at(finished_s, lambda _t: self._finish_step(report))

    def _finish_step(self, report: StepReport) -> None:
        self._busy = False
        self._idle_until_event = report.result.num_input_tokens == 0
        t0 = time.perf_counter()
        self.beat.on_step(report)
        self.overhead.runtime_s += time.perf_counter() - t0
