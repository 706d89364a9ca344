"""Wall-clock driver: the engine on its own thread, the beat on the asyncio event loop.

The event loop never blocks on model math: engine commands (open, submit, cancel, close)
go to the engine thread through a queue and run between steps; each step's report comes
back to the loop with `call_soon_threadsafe`. Deadlines are loop timers. Both sides read
`time.monotonic()` (the asyncio loop's clock), in seconds since the driver started.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from metronome.engine.engine import Engine, SessionError
from metronome.engine.session import SessionSpec
from metronome.runtime.beat import Beat
from metronome.runtime.frame import FrameResult
from metronome.runtime.ports import OverheadMeter, StepReport

log = logging.getLogger(__name__)


class EngineThread:
    """Owns the engine: every engine call happens on this thread."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, on_report,
                 overhead: OverheadMeter, origin_s: float) -> None:
        self.engine = engine
        self.origin_s = origin_s
        self.overhead = overhead
        self.loop = loop
        self.on_report = on_report
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.error: str | None = None  # set if a step ever failed: health reports it
        # After a step in which nobody could work (all stalled on KV), nothing changes until
        # a command arrives (a close, new input): wait for one instead of spinning.
        self._idle_until_command = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metronome-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.commands.put(lambda: None)
        self._thread.join(timeout=10)

    def validate(self, token_ids, embeddings) -> None:
        self.engine.check_input(token_ids, embeddings)

    # EnginePort: called from the loop thread, applied on the engine thread
    def open(self, session_id: int, spec: SessionSpec) -> None:
        self.commands.put(lambda: self.engine.open_session(spec, session_id=session_id))

    def submit(self, session_id, token_ids, embeddings, max_new_tokens) -> None:
        self.commands.put(
            lambda: self.engine.submit(session_id, token_ids, embeddings, max_new_tokens)
        )

    def cancel(self, session_id: int) -> None:
        self.commands.put(lambda: self.engine.cancel_generation(session_id))

    def close(self, session_id: int) -> None:
        self.commands.put(lambda: self.engine.close(session_id))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work or self._idle_until_command)
            if self.engine.has_work and not self._idle_until_command and not self._stop.is_set():
                self._guarded_step()

    def _drain(self, block: bool) -> None:
        try:
            command = self.commands.get(timeout=0.05) if block else self.commands.get_nowait()
            while True:
                self._apply(command)
                self._idle_until_command = False
                command = self.commands.get_nowait()
        except queue.Empty:
            return

    @staticmethod
    def _apply(command: Callable[[], None]) -> None:
        try:
            command()
        except SessionError as err:  # one session's bad request never stops the engine
            log.warning("engine refused a command: %s", err)
        except Exception:  # nor does anything else a command raises
            log.exception("engine command failed")

    def _guarded_step(self) -> None:
        try:
            self._step()
        except Exception as err:  # keep serving closes; health says the engine failed
            log.exception("engine step failed")
            self.error = f"{type(err).__name__}: {err}"
            self._idle_until_command = True

    def _step(self) -> None:
        started_s = time.monotonic() - self.origin_s
        result = self.engine.step()
        finished_s = time.monotonic() - self.origin_s
        report = StepReport(
            result, started_s, finished_s, self.engine.pool_stats(),
            {sid: self.engine.resident_tokens(sid) for sid in self.engine.sessions},
        )
        self.loop.call_soon_threadsafe(self.on_report, report)
        self.overhead.engine_s += finished_s - started_s
        self.overhead.runtime_s += time.monotonic() - self.origin_s - finished_s
        self.overhead.steps += 1
        self._idle_until_command = result.num_input_tokens == 0


class LoopScheduler:
    """Loop timers in seconds since `origin_s` (a loop.time() value)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin_s: float) -> None:
        self.loop = loop
        self.origin_s = origin_s

    def call_at(self, at_s: float, callback: Callable[[float], None]) -> None:
        self.loop.call_at(self.origin_s + at_s, lambda: callback(self.now_s()))

    def now_s(self) -> float:
        return self.loop.time() - self.origin_s


class WallDriver:
    """Serve on the wall clock. Create inside a running event loop; `close()` when done."""

    def __init__(
        self,
        engine: Engine,
        on_result: Callable[[FrameResult], None],
        on_step: Callable[[StepReport], None] | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.overhead = OverheadMeter()
        self.clock = LoopScheduler(loop, loop.time())
        self.worker = EngineThread(engine, loop, self._on_report, self.overhead,
                                   self.clock.origin_s)
        self.beat = Beat(self.worker, self.clock, on_result, on_step)
        self.worker.start()

    def call_on_engine(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread after the commands queued so far (e.g. read the pool
        right after a close); fn must not block."""
        self.worker.commands.put(fn)

    def _on_report(self, report: StepReport) -> None:
        started = time.perf_counter()
        self.beat.on_step(report)
        self.overhead.runtime_s += time.perf_counter() - started

    def now_s(self) -> float:
        return self.clock.now_s()

    def close(self) -> None:
        self.worker.stop()
