"""Which thread runs torch's parallel kernels: the engine thread, alone.

torch's CPU kernels run on OpenMP, and libgomp keeps one pool of worker threads for every
thread that has opened a parallel region. A live server steps its engine on `WallDriver`'s
thread while the model was loaded and warmed up on the main thread. Measured on a 2-core
machine (SmolLM2 in bf16, one session decoding, a script's side-by-side runs): a step on the
engine thread took 22.6 ms when the main thread had run torch with 2 threads before, and
12.9 ms when the main thread had run it with 1 (13.4 ms for the same step on the main thread
alone). Making the main thread single-threaded afterwards does not undo it (21.2 ms): its pool
exists by then. So the wall-clock entry points (`metronome serve`, `metronome run`, a cluster
replica, `bench vllm`'s native streaming arm) call `reserve_for_engine_thread()` before
anything parallel runs on the main thread, and the engine thread calls `enter_engine_thread()`
first thing. (`bench admission` runs its wall-clock part in a spawned process that does.)

torch keeps the last count set as the default for threads that start later, so helper threads
that run torch (the audio encoder) call `single_threaded()` first: they never get a pool.

The same call shortens the interpreter's GIL switch interval (`ENGINE_SWITCH_INTERVAL_S`).
The engine thread drops the GIL inside every torch op and must take it back to start the
next one, a few hundred times a step; while the loop thread runs Python (frame results,
events, timers) each take-back waits up to the switch interval, 5 ms by default: a GIL
convoy. Measured on the streaming workload (bench vllm's native arm, 48 sessions, 16 in /
4 out per 1 s frame, 2 cores): steps took 201 ms at the median with 5 ms and 63 ms with
0.5 ms, goodput 0.48 -> 0.75, although the loop thread used only 1.2 s of CPU in 33 s.

vLLM (`--engine vllm`) gets the switch interval only (`shorten_gil_switch`): its CPU worker
binds its own OpenMP threads when it starts, ignores `torch.set_num_threads` from then on,
and its attention checks that a step runs on the thread count its metadata was planned
for; a main thread set to one thread before vLLM starts failed a streaming run here with
`Check failed: input->metadata->thread_num == thread_num (2 vs. 1)`.
"""

from __future__ import annotations

import sys
import threading

import torch

_lock = threading.Lock()
_engine_threads: int | None = None
ENGINE_SWITCH_INTERVAL_S = 0.0005  # process-wide (sys.setswitchinterval); default 0.005


def reserve_for_engine_thread(threads: int | None = None) -> int:
    """Run the calling thread's torch on one thread, and keep `threads` (default: torch's count
    now) for the engine thread; shorten the GIL switch interval (see above). Call on the
    main thread before it runs anything parallel (before loading the model); calling again
    keeps the first reservation. Returns it."""
    global _engine_threads
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    with _lock:
        if _engine_threads is None:
            _engine_threads = threads or torch.get_num_threads()
        torch.set_num_threads(1)
        shorten_gil_switch()
        return _engine_threads


def shorten_gil_switch() -> None:
    """The GIL switch interval an engine thread beside the event loop needs (see above)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))


def reserved_engine_threads() -> int | None:
    """The engine thread's reserved count (None: nothing reserved, torch's defaults hold)."""
    return _engine_threads


def enter_engine_thread() -> None:
    """First thing on the engine thread: take the reserved threads (none reserved: keep
    torch's default for a new thread)."""
    if _engine_threads is not None:
        torch.set_num_threads(_engine_threads)


def single_threaded() -> None:
    """First thing on a helper thread that runs torch (a ThreadPoolExecutor initializer)."""
    torch.set_num_threads(1)
