"""The one workload runner: the sessions of a `sim.workload.Workload` stream frames to an
engine (any `EnginePort`) on the beat, on the wall clock ("wall", the engine on its thread as
`metronome serve` runs it) or the virtual one ("virtual", step time from a cost model); or,
for a baseline, with no beat ("fifo": a session's next frame goes in when its last is done,
as vLLM's streaming input does). `admission(active_sessions)` builds a controller that gates
every session's open. Every frame submitted comes back, answered or not (`summary`).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from metronome.runtime.ports import Listeners
from metronome.sim.recorder import RunRecorder
from metronome.sim.workload import frame_offsets_s, schedule
from metronome.stats import percentile
from metronome.stream import Frame, FrameStatus, Stream


@dataclass
class Run:
    frames: list[Frame]  # every frame submitted; status None: never answered
    stopped_s: float  # frames due: those a deadline before it
    deadline_s: float
    recorder: RunRecorder = field(default_factory=RunRecorder)  # the beat's frames and steps
    overhead: dict | None = None  # the runtime's own time beside the engine's
    controller: object = None


def run_workload(engine, workload, profile, source, clock: str = "wall", cost=None,
                 admission=None, until_s: float | None = None, log=None) -> Run:
    end_s = until_s if until_s is not None else workload.end_s + 2 * profile.frame_period_s
    if clock == "fifo":
        return _fifo(engine, workload, profile, source, end_s)
    run, streams = Run([], end_s, profile.deadline_s), {}
    run.controller = admission(lambda: len(streams)) if admission else None
    listeners = Listeners.of(*(x for x in (run.recorder, run.controller) if x))

    def start(driver, timer) -> None:
        nonlocal streams
        streams = driver.beat.streams
        schedule(workload, profile, driver.beat, timer, source,
                 gate=run.controller and run.controller.try_admit)
        if run.controller is not None:
            run.controller.start(timer)

    if clock == "virtual":
        from metronome.sim.virtual import VirtualDriver

        driver = VirtualDriver(engine, cost, listeners)
        start(driver, driver.clock)
        driver.run_until(end_s)
    else:
        driver = asyncio.run(_wall(engine, listeners, start, run, end_s, log))
    run.overhead = driver.overhead.summary()
    answered = {id(f) for f in run.recorder.results}
    run.frames = sorted(run.recorder.results + [f for s in streams.values() for f in s.frames
                                                if id(f) not in answered],
                        key=lambda f: f.arrival_s)
    return run


async def _wall(engine, listeners, start, run: Run, end_s: float, log):
    from metronome.runtime.wall import WallDriver

    driver = WallDriver(engine, listeners)
    start(driver, driver.timer)
    try:
        while (now_s := driver.now_s()) < end_s:
            await asyncio.sleep(0.5)
            if log and int(now_s + 0.5) // 10 > int(now_s) // 10:  # every 10 s
                s = run.recorder.summary()
                log(f"t={now_s:.0f} s: {s['frames']} frames, goodput {s['goodput'] or 0:.3f}")
    finally:
        driver.close()
    if driver.error:
        raise RuntimeError(f"the engine thread failed: {driver.error}")
    run.stopped_s = driver.now_s()
    return driver


def _fifo(engine, workload, profile, source, end_s: float) -> Run:
    """Each session's frames in arrival order, the next when the last is done."""
    arrivals = sorted(((open_s + offset, k, i) for k, (open_s, duration) in enumerate(
        workload.plan()) for i, offset in enumerate(frame_offsets_s(
            duration, profile.frame_period_s))), reverse=True)
    streams = [Stream(f"s{k}", spec=profile.spec) for k in range(workload.num_sessions)]
    sids = [engine.open_session(stream) for stream in streams]
    waiting, running = [deque() for _ in sids], {}  # running: session -> (frame, input end)
    consumed, frames, started = Counter(), [], time.perf_counter()
    while (now := time.perf_counter() - started) < end_s:
        while arrivals and arrivals[-1][0] <= now:
            at_s, k, index = arrivals.pop()
            frames.append(Frame(sids[k], at_s, index=index, deadline_at_s=at_s
                                + profile.deadline_s,
                                max_new_tokens=profile.max_output_tokens_per_frame))
            waiting[k].append(frames[-1])
        for k, sid in enumerate(sids):
            if sid not in running and waiting[k]:
                frame = waiting[k].popleft()
                engine.submit(sid, source(k, frame.index)[0], max_new_tokens=frame.max_new_tokens)
                running[sid] = (frame, streams[k].received_tokens)
        if not engine.has_work:
            time.sleep(0.002)
            continue
        out = engine.step()
        for sid, (frame, end) in list(running.items()):
            consumed[sid] += out.consumed_tokens.get(sid, 0)
            frame.token_ids += out.new_token_ids.get(sid, [])
            if consumed[sid] >= end and sid not in out.generating:
                frame.status, frame.finish_s = FrameStatus.OK, time.perf_counter() - started
                del running[sid]
    for sid in sids:
        engine.close(sid)
    return Run(frames, time.perf_counter() - started, profile.deadline_s)


def summary(run: Run) -> dict:
    """One rule for every clock: the frames due (arrived a deadline before the run stopped),
    those never answered, goodput (due frames done with their output within the deadline,
    over frames due), the latency of the answered ones, stalls on KV."""
    due = [f for f in run.frames if f.arrival_s + run.deadline_s <= run.stopped_s]
    answered = [f for f in due if f.status is not None]
    latency_ms = sorted(f.latency_s * 1e3 for f in answered)
    never = [f.arrival_s for f in due if f.status is None]
    stalls = [f.arrival_s for f in due if f.status is FrameStatus.STALLED_KV]
    steps = run.recorder.summary()
    return {"frames": len(due), "never_answered": len(never),
            "first_unanswered_s": min(never, default=None),
            "goodput": sum(f.good for f in due) / len(due) if due else None,
            "deadline_met": sum(f.deadline_met for f in answered) / len(due) if due else None,
            "p50_ms": percentile(latency_ms, 50), "p95_ms": percentile(latency_ms, 95),
            "max_ms": max(latency_ms, default=None), "stalled_kv": len(stalls),
            "first_stall_s": min(stalls, default=None), "step_p50_ms": steps["step_ms"]["p50"],
            "runtime_share": (run.overhead or {}).get("runtime_share_of_step")}


def in_fresh_process(fn, *args, env: dict[str, str] | None = None):
    """`fn(*args)` in a spawned process (`env` added to its environment): nothing of this
    one carries over, neither engine or registry state nor torch's thread pools (a
    wall-clock run's `fn` calls `runtime.cores.reserve_for_engine_thread()` first)."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(fn, *args).result()
    finally:
        os.environ.clear()
        os.environ.update(saved)
