"""One voice stage: a worker thread, the model that runs on it, and the stage's time metric.

A stage runs every session's work of its kind on its one thread, in the order it was asked
(`run`), and its futures resolve on the loop in that order, so each session's stateful
stream (a transcript, a VAD stream, a reply's voice) sees its pieces in sequence and no
model runs on the loop or on the engine's thread. Its model is loaded on its own thread:
at once (`load`: the server's start pays for it, with one warm-up run), or by the first
work that needs it (`lazy`). The thread starts when the stage is made: an executor starts
its thread on its first submit, on the caller's thread, and the loop paid 1-4 ms of CPU
for that on a session's first audio.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from metronome.observe.metrics import Metrics
from metronome.runtime.cores import single_threaded

M = TypeVar("M")  # the stage's model
T = TypeVar("T")


class Stage(Generic[M]):
    def __init__(self, name: str, metric_label: str, loop: asyncio.AbstractEventLoop,
                 metrics: Metrics, load: Callable[[], M] | None = None,
                 lazy: bool = False) -> None:
        """`name`: its thread's (`metronome-<name>`); `metric_label`: its label in
        `metronome_voice_stage_seconds`; `load` (None: no model) runs on its thread now,
        or, `lazy`, when the first work needs the model."""
        self.name = name
        self.metric_label = metric_label
        self._loop = loop
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix=f"metronome-{name}",
                                            initializer=single_threaded)
        self._executor.submit(lambda: None).result()  # its thread starts now
        self._load = load
        self._model: M | None = None
        if load is not None and not lazy:
            self._model = self._executor.submit(load).result()

    @property
    def model(self) -> M | None:
        """Its model, once loaded (None: not yet, or none)."""
        return self._model

    def run(self, work: Callable[[], T]) -> asyncio.Future[T]:
        """`work` on the stage's thread, after what was asked before; its future resolves on
        the loop, in call order."""
        return self._loop.run_in_executor(self._executor, work)

    def run_model(self, work: Callable[[M], T]) -> asyncio.Future[T]:
        """`work` with the stage's model (loaded first if it is lazy and not yet loaded)."""
        return self._loop.run_in_executor(self._executor, lambda: work(self._loaded()))

    def observe(self, seconds: float) -> None:
        """One piece of this stage's work took `seconds` (any thread)."""
        self._metrics.observe_voice_stage(self.metric_label, seconds)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _loaded(self) -> M:
        """On the stage's thread: its model, loaded by its first user."""
        if self._model is None:
            assert self._load is not None, f"the {self.name} stage has no model"
            self._model = self._load()
        return self._model
