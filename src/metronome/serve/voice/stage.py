"""One voice stage: a worker thread, the model that runs on it, and the stage's time metric.

A stage runs every session's work of its kind on its one thread, in the order it was asked
(`run`), and its futures resolve on the loop in that order, so each session's stateful
stream (a transcript, a VAD stream, a reply's voice) sees its pieces in sequence and no
model runs on the loop or on the engine's thread. Work with a deadline (`due_s`: a reply's
sentence, due when its listener would run dry; a frame's input on the hear stage, due at its
arrival, a turn's end sooner: `serve.realtime.intake`) goes by deadline instead,
earliest first (ties in call order), so a reply whose listener has seconds of audio left
yields the thread to one about to run dry or not yet begun; each session keeps its own
pieces in order by giving them deadlines that never decrease. Queued work whose future is
cancelled (a reply the user spoke over) never runs. Its model is loaded on its own thread:
at once (`load`: the server's start pays for it, with one warm-up run), or by the first
work that needs it (`lazy`). The thread starts when the stage is made: an executor starts
its thread on its first submit, on the caller's thread, and the loop paid 1-4 ms of CPU
for that on a session's first audio.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

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
        # work by deadline: (due_s, call number, work, its future); one executor task each
        self._due: list[tuple[float, int, Callable[[], Any], asyncio.Future[Any]]] = []
        self._due_lock = threading.Lock()
        self._calls = itertools.count()
        if load is not None and not lazy:
            self._model = self._executor.submit(load).result()

    @property
    def model(self) -> M | None:
        """Its model, once loaded (None: not yet, or none)."""
        return self._model

    def run(self, work: Callable[[], T], due_s: float = -math.inf) -> asyncio.Future[T]:
        """`work` on the stage's thread, after what was asked before, or, with `due_s` (the
        loop's clock), before any queued work due later; its future resolves on the loop.
        Cancel the future to drop the work if it has not begun."""
        if due_s == -math.inf:
            return self._loop.run_in_executor(self._executor, work)
        future: asyncio.Future[T] = self._loop.create_future()
        with self._due_lock:
            heapq.heappush(self._due, (due_s, next(self._calls), work, future))
        self._executor.submit(self._run_earliest)  # each task runs the earliest queued then
        return future

    def run_model(self, work: Callable[[M], T], due_s: float = -math.inf) -> asyncio.Future[T]:
        """`work` with the stage's model (loaded first if it is lazy and not yet loaded), as
        `run` runs work."""
        return self.run(lambda: work(self._loaded()), due_s)

    @property
    def queued_due(self) -> int:
        """Work with a deadline queued and not begun."""
        return len(self._due)

    def _run_earliest(self) -> None:
        """On the stage's thread: the earliest-due work queued (skipped if cancelled)."""
        with self._due_lock:
            if not self._due:  # closed
                return
            _, _, work, future = heapq.heappop(self._due)
        if future.cancelled():
            return
        try:
            result = work()
        except BaseException as error:  # told to its future, as run_in_executor does
            self._loop.call_soon_threadsafe(_settle, future, None, error)
            return
        self._loop.call_soon_threadsafe(_settle, future, result, None)

    def observe(self, seconds: float) -> None:
        """One piece of this stage's work took `seconds` (any thread)."""
        self._metrics.observe_voice_stage(self.metric_label, seconds)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._due_lock:  # its sessions are closed: nobody waits for that work
            self._due.clear()

    def _loaded(self) -> M:
        """On the stage's thread: its model, loaded by its first user."""
        if self._model is None:
            assert self._load is not None, f"the {self.name} stage has no model"
            self._model = self._load()
        return self._model


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """On the loop: a deadline work's outcome, unless its future was cancelled meanwhile."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
