"""The one workload runner: the sessions of a `sim.workload.Workload` stream frames to an
engine (any `EnginePort`), and every frame submitted comes back, answered or not.

    run = run_workload(engine, workload, profile, source, clock="virtual", cost=cost)
    summary(run)   # frames due, never answered, goodput, latency p50/p95, stalls

clock "wall": the beat on the wall clock (the engine on its thread, as `metronome serve`
runs it); "virtual": the beat with step time from a `StepCostModel` (deterministic);
"fifo": no beat, for a baseline: a session's next frame goes to the engine when its last
one is done (as vLLM's streaming input does), answered when its work is; nothing answers a
frame the engine never gets to. `admission(active_sessions)` builds an admission
controller that gates every session's open (refused sessions go away).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from metronome.runtime.observer import RuntimeObserver
from metronome.runtime.ports import Listeners
from metronome.sim.recorder import RunRecorder
from metronome.sim.workload import frame_offsets_s, schedule
from metronome.stats import percentile
from metronome.stream import Frame, FrameStatus, Stream


@dataclass
class Run:
    frames: list[Frame]  # every frame submitted; status None: never answered
    stopped_s: float  # when the run stopped (frames due: a deadline before it)
    deadline_s: float
    recorder: RunRecorder = field(default_factory=RunRecorder)  # the beat's results, steps
    health: list[tuple[float, str]] = field(default_factory=list)  # (t, the observer's state)
    overhead: dict | None = None  # the runtime's own time beside the engine's
    controller: object = None  # the admission controller, if any


def run_workload(engine, workload, profile, source, clock: str = "wall", cost=None,
                 admission: Callable[[Callable[[], int]], object] | None = None,
                 until_s: float | None = None, tick_s: float = 1.0,
                 log: Callable[[str], None] | None = None) -> Run:
    end_s = until_s if until_s is not None else workload.end_s + 2 * profile.frame_period_s
    if clock == "fifo":
        return _fifo(engine, workload, profile, source, end_s, log)
    run = Run([], end_s, profile.deadline_s)
    observer = RuntimeObserver.create(engine.config.block_size, health_window_s=2.0)
    streams: dict = {}  # the beat's, once its driver is built
    run.controller = admission(lambda: len(streams)) if admission else None
    listeners = Listeners.of(*(x for x in (run.recorder, observer, run.controller) if x))

    def start(driver, timer) -> None:
        nonlocal streams
        streams = driver.beat.streams
        schedule(workload, profile, driver.beat, timer, source,
                 gate=run.controller.try_admit if run.controller else None)
        if run.controller is not None:
            run.controller.start(timer)

    def tick(now_s: float) -> None:
        run.health.append((now_s, observer.health_summary(now_s)["state"]))
        if log and len(run.health) % max(1, round(10 / tick_s)) == 0:
            s = run.recorder.summary()
            log(f"t={now_s:.0f} s: {s['frames']} frames, goodput {s['goodput'] or 0:.3f}, "
                f"{len(streams)} sessions, health {run.health[-1][1]}")

    if clock == "virtual":
        from metronome.sim.virtual import VirtualDriver

        driver = VirtualDriver(engine, cost, listeners)
        start(driver, driver.clock)
        now_s = 0.0
        while now_s < end_s:
            now_s = min(end_s, now_s + tick_s)
            driver.run_until(now_s)
            tick(now_s)
    else:
        driver = asyncio.run(_wall(engine, listeners, start, run, end_s, tick_s, tick))
    run.overhead = driver.overhead.summary()
    answered = {id(f) for f in run.recorder.results}
    run.frames = run.recorder.results + [f for s in streams.values() for f in s.frames
                                         if id(f) not in answered]
    run.frames.sort(key=lambda f: f.arrival_s)
    return run


async def _wall(engine, listeners, start, run: Run, end_s: float, tick_s: float, tick):
    from metronome.runtime.wall import WallDriver

    driver = WallDriver(engine, listeners)
    start(driver, driver.timer)
    try:
        while driver.now_s() < end_s:
            await asyncio.sleep(tick_s)
            tick(driver.now_s())
    finally:
        driver.close()
    if driver.error:
        raise RuntimeError(f"the engine thread failed: {driver.error}")
    run.stopped_s = driver.now_s()
    return driver


def _fifo(engine, workload, profile, source, end_s: float, log) -> Run:
    """Each session's frames in arrival order, the next when the last is done."""
    plans, out_tokens = workload.plan(), profile.max_output_tokens_per_frame
    arrivals = [(open_s + offset, k, i) for k, (open_s, d) in enumerate(plans)
                for i, offset in enumerate(frame_offsets_s(d, profile.frame_period_s))]
    arrivals.sort(reverse=True)
    streams = [Stream(f"s{k}", spec=profile.spec) for k in range(len(plans))]
    sids = [engine.open_session(stream) for stream in streams]
    waiting: list[deque[Frame]] = [deque() for _ in sids]
    running: dict[str, tuple[Frame, int]] = {}  # session -> (frame, its input's end)
    consumed, frames = Counter(), []
    started = time.perf_counter()
    while (now := time.perf_counter() - started) < end_s:
        while arrivals and arrivals[-1][0] <= now:
            at_s, k, index = arrivals.pop()
            frame = Frame(sids[k], at_s, index=index, max_new_tokens=out_tokens,
                          deadline_at_s=at_s + profile.deadline_s)
            waiting[k].append(frame)
            frames.append(frame)
        for k, sid in enumerate(sids):
            if sid not in running and waiting[k]:
                frame = waiting[k].popleft()
                engine.submit(sid, source(k, frame.index)[0], max_new_tokens=out_tokens)
                running[sid] = (frame, streams[k].received_tokens)
        if not engine.has_work:
            time.sleep(0.002)
            continue
        out = engine.step()
        done_s = time.perf_counter() - started
        for sid, (frame, end) in list(running.items()):
            consumed[sid] += out.consumed_tokens.get(sid, 0)
            frame.token_ids += out.new_token_ids.get(sid, [])
            if consumed[sid] >= end and sid not in out.generating:
                frame.status, frame.finish_s = FrameStatus.OK, done_s
                del running[sid]
    for sid in sids:
        engine.close(sid)
    return Run(frames, time.perf_counter() - started, profile.deadline_s)


def summary(run: Run) -> dict:
    """One rule for every clock: the frames due (arrived a deadline before the run stopped),
    those never answered, goodput (due frames done with their output within the deadline,
    over frames due), the latency of the answered ones, stalls on KV, health."""
    due = [f for f in run.frames if f.arrival_s + run.deadline_s <= run.stopped_s]
    answered = [f for f in due if f.status is not None]
    latency_ms = sorted(f.latency_s * 1e3 for f in answered)
    never = [f.arrival_s for f in due if f.status is None]
    stalls = [f.arrival_s for f in due if f.status is FrameStatus.STALLED_KV]
    critical = [t for t, state in run.health if state == "critical"]
    return {"frames": len(due), "never_answered": len(never),
            "first_unanswered_s": min(never, default=None),
            "goodput": sum(f.good for f in due) / len(due) if due else None,
            "deadline_met": sum(f.deadline_met for f in answered) / len(due) if due else None,
            "p50_ms": percentile(latency_ms, 50), "p95_ms": percentile(latency_ms, 95),
            "max_ms": max(latency_ms, default=None), "stalled_kv": len(stalls),
            "first_stall_s": min(stalls, default=None),
            "by_status": dict(Counter(str(f.status) for f in due if f.status)),
            "health": run.health[-1][1] if run.health else None,
            "critical_from_s": min(critical, default=None),
            "step_p50_ms": run.recorder.summary()["step_ms"]["p50"],
            "peak_used_blocks": run.recorder.summary()["peak_used_blocks"],
            "runtime_share": (run.overhead or {}).get("runtime_share_of_step")}


def in_fresh_process(fn: Callable, *args, env: dict[str, str] | None = None):
    """`fn(*args)` in a spawned process (`env` added to its environment): nothing of this
    process carries over, neither engine or registry state nor torch's thread pools (a
    wall-clock run's `fn` calls `runtime.cores.reserve_for_engine_thread()` first)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            future = pool.submit(fn, *args)
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.update({key: value})
    return future.result()
