"""Wall-clock driver: the engine on its own thread, the beat on the asyncio event loop.

Engine commands (open, feed, cancel, close) go from the loop to the engine thread through
a queue and run between steps; each step's report comes back to the loop with
`call_soon_threadsafe`. So model math never runs on the loop (what else runs there, the
server's own work, is the server's business: see `serve.serving`). Deadlines are loop
timers. Both sides read `time.monotonic()` (the asyncio loop's clock), in seconds since the
driver started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

from metronome.engine.engine import SessionError
from metronome.runtime.cores import enter_engine_thread
from metronome.runtime.driver import Driver
from metronome.runtime.ports import EnginePort, Listeners

log = logging.getLogger(__name__)

Command = Callable[[], object]
T = TypeVar("T")


class LoopTimer:
    """Loop timers in seconds since `origin_s` (a loop.time() value)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin_s: float) -> None:
        self.loop = loop
        self.origin_s = origin_s

    def call_at(self, at_s: float, callback: Callable[[float], None]) -> None:
        self.loop.call_at(self.origin_s + at_s, lambda: callback(self.now_s()))

    def now_s(self) -> float:
        return self.loop.time() - self.origin_s  # loop.time() is monotonic: any thread


class WallDriver(Driver):
    """Serve on the wall clock. Create inside a running event loop; `close()` when done."""

    def __init__(self, engine: EnginePort, listeners: Listeners) -> None:
        self.loop = asyncio.get_running_loop()
        self.timer = LoopTimer(self.loop, self.loop.time())
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        super().__init__(engine, self.call_on_engine, self.run_on_engine, self.timer, listeners)
        self.error: str | None = None  # set if a step ever failed: health reports it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metronome-engine", daemon=True)
        self._thread.start()

    def now_s(self) -> float:
        return self.timer.now_s()

    def call_on_engine(self, fn: Command) -> None:
        """Run fn on the engine thread after the commands queued so far (the beat's engine
        commands; a pool reading right after a close); fn must not block."""
        self._commands.put(fn)

    def run_on_engine(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """`call_on_engine`, with fn's result (or exception) as a future on the loop."""
        future: asyncio.Future[T] = self.loop.create_future()

        def settle(outcome: Callable[[], None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: shutting down
                self.loop.call_soon_threadsafe(outcome)

        def run() -> None:
            try:
                value = fn()
            except Exception as err:  # the caller's to handle, on the loop
                failure = err

                def fail() -> None:
                    if not future.done():
                        future.set_exception(failure)
                settle(fail)
                return

            def succeed() -> None:
                if not future.done():
                    future.set_result(value)
            settle(succeed)

        self.call_on_engine(run)
        return future

    def close(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        enter_engine_thread()  # the cores reserved for this thread (runtime.cores)
        while not self._stop.is_set():
            self._drain(block=not self.should_step)
            if self.should_step and not self._stop.is_set():
                self._guarded_step()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
            while True:
                self._apply(command)
                self.on_command()
                command = self._commands.get_nowait()
        except queue.Empty:
            return

    @staticmethod
    def _apply(command: Command) -> None:
        try:
            command()
        except SessionError as err:  # one session's bad request never stops the engine
            log.warning("engine refused a command: %s", err)
        except Exception:  # nor does anything else a command raises
            log.exception("engine command failed")

    def _guarded_step(self) -> None:
        try:
            report = self.run_step(self.now_s(), lambda _result: self.now_s())
        except Exception as err:  # keep serving closes; health says the engine failed
            log.exception("engine step failed")
            self.error = f"{type(err).__name__}: {err}"
            self._idle = True
            return
        self.loop.call_soon_threadsafe(self.deliver, report)
