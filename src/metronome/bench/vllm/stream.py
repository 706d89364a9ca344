"""The streaming workload of `metronome bench vllm` on both arms, summarized by one rule.

Stock vLLM is its scheduler alone (a session's next chunk goes in when its last one is done,
as `AsyncLLM`'s streaming input does); Metronome on vLLM is the same engine under the beat.
Each arm yields one record per frame sent: (arrival_s, answered_s or None, complete), where
complete means the frame's work was done with its output (stock: its chunk finished;
Metronome: status ok, with its output tokens). `summarize_frames` turns both into the same
numbers over the same denominator: the frames *due*, those that arrived at least one
deadline before the arm stopped.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from metronome.bench.vllm.engines import DTYPE, sliding_window_overrides, text_ids
from metronome.bench.vllm.names import STREAM_ARMS
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.stats import percentile

HEALTH_WINDOW_S = 2.0  # health over the last control interval, as metronome serve has it
Log = Callable[[str], None]
FrameRecord = tuple[float, float | None, bool]  # (arrival_s, answered_s | None, complete)


def summarize_frames(frames: list[FrameRecord], deadline_s: float, stopped_s: float) -> dict:
    """Due frames, those never answered, goodput (frames due that were complete within the
    deadline / frames due) and the latency of the answered ones."""
    due = [f for f in frames if f[0] + deadline_s <= stopped_s]
    never = [f for f in due if f[1] is None]
    good = [f for f in due if f[1] is not None and f[2] and f[1] - f[0] <= deadline_s]
    latencies_ms = sorted((f[1] - f[0]) * 1e3 for f in due if f[1] is not None)
    return {"frames": len(due), "never_answered": len(never),
            "first_unanswered_arrival_s": min((f[0] for f in never), default=None),
            "goodput": len(good) / len(due) if due else None,
            "latency_ms_p50": percentile(latencies_ms, 50),
            "latency_ms_p95": percentile(latencies_ms, 95),
            "deadline_s": deadline_s, "stopped_s": stopped_s}


def _stream_engine(cfg, sessions: int, policy: ResidencyPolicy, sliding_window: bool = False):
    from metronome.model.weights import bundled_model_dir
    from metronome.vllm.engine import VllmEngine, VllmEngineConfig

    overrides = None
    if sliding_window:  # vLLM's own sliding window of S + W on every layer
        overrides = sliding_window_overrides(cfg.bound)
    engine = VllmEngine.start(VllmEngineConfig(
        model_dir=str(bundled_model_dir()), policy=policy, pool_tokens=cfg.stream_pool_tokens,
        block_size=cfg.block_size, max_model_len=8192, max_num_seqs=sessions, dtype=DTYPE,
        hf_overrides=overrides))
    engine.warm_up()
    return engine


def _workload(cfg, sessions: int):
    """Every arm's workload: the same sessions, opened at the same phases of the period
    (`cfg.stream_phases`), so their frames arrive at the same times in every arm."""
    from metronome.sim.workload import Workload

    return Workload(sessions, cfg.stream_duration_s, arrival_spread_s=cfg.stream_period_s,
                    even_arrivals=cfg.stream_phases == "even")


def stream_stock(cfg, sessions: int, log: Log, sliding_window: bool = False) -> dict:
    """vLLM's scheduler alone (full attention, or its own sliding window of S + W): each
    session's frames go in FIFO as chunks of its one resumable request, the next when the
    last is done; a frame is answered when its chunk is. Nothing answers a frame the engine
    never gets to."""
    engine = _stream_engine(cfg, sessions, ResidencyPolicy.unbounded(), sliding_window)
    ids = text_ids(50_000)
    try:
        sids = [engine.open_session(SessionSpec(stop_token_ids=())) for _ in range(sessions)]
        frames = {sid: [] for sid in sids}  # [arrival_s, answered_s | None]
        waiting = {sid: [] for sid in sids}
        running: dict[int, int] = {}  # session -> frame index in flight
        arrivals_s = _workload(cfg, sessions).frame_arrivals_s(cfg.stream_period_s)
        next_frame = [0] * sessions
        t0 = time.perf_counter()
        last_report = 0.0
        while (now := time.perf_counter() - t0) < cfg.stream_duration_s:
            for k, sid in enumerate(sids):
                while next_frame[k] < len(arrivals_s[k]) and arrivals_s[k][next_frame[k]] <= now:
                    waiting[sid].append(len(frames[sid]))
                    frames[sid].append([arrivals_s[k][next_frame[k]], None])
                    next_frame[k] += 1
            for k, sid in enumerate(sids):
                if sid not in running and waiting[sid]:
                    index = waiting[sid].pop(0)
                    offset = (k * 3001 + index * cfg.stream_tokens_in) % 40_000
                    engine.submit_prepared(sid, engine.prepare_input(
                        ids[offset:offset + cfg.stream_tokens_in], None), cfg.stream_tokens_out)
                    running[sid] = index
            if engine.has_work:
                engine.step()
                done_s = time.perf_counter() - t0
                for sid in list(running):
                    if engine.sessions[sid].running is None:
                        frames[sid][running.pop(sid)][1] = done_s
            else:
                time.sleep(0.002)
            if now - last_report >= 10:
                last_report = now
                answered = sum(f[1] is not None for rows in frames.values() for f in rows)
                total = sum(len(rows) for rows in frames.values())
                log(f"  stock t={now:5.0f} s: {answered}/{total} frames answered, "
                    f"pool {engine.pool_stats().used_blocks}/{engine.num_blocks}")
        stopped_s = time.perf_counter() - t0
        pool = engine.pool_stats()
    finally:
        engine.shutdown()
    # a finished chunk is the frame's whole output (stream_tokens_out tokens)
    records = [(arrival, answered, answered is not None)
               for rows in frames.values() for arrival, answered in rows]
    return {"run": "vLLM sliding window" if sliding_window else "stock vLLM",
            "sessions": sessions, **summarize_frames(records, cfg.stream_period_s, stopped_s),
            "first_stall_arrival_s": None, "stalled_kv_frames": None,
            "final_used_blocks": pool.used_blocks,
            "num_blocks": pool.num_blocks}


class _SentFrames:
    """The beat, with every frame submitted to it noted (a frame the beat never answers
    is then counted, not lost)."""

    def __init__(self, beat) -> None:
        self._beat = beat
        self.arrival_s: dict[tuple[int, int], float] = {}

    def __getattr__(self, name: str):
        return getattr(self._beat, name)

    def submit_frame(self, frame, now_s: float):
        self.arrival_s[(frame.session_id, frame.index)] = frame.arrival_s
        return self._beat.submit_frame(frame, now_s)


def _native_engine(cfg):
    """The native engine as `metronome serve` runs it: its default configuration, the bundled
    model in the same dtype, the same pool; its engine thread owns the cores (runtime.cores,
    reserved before the model loads, as serve does)."""
    from metronome.bench.vllm.engines import load_native_model
    from metronome.engine.engine import Engine, EngineConfig
    from metronome.runtime.cores import reserve_for_engine_thread

    reserve_for_engine_thread()
    engine = Engine(load_native_model(), EngineConfig(pool_tokens=cfg.stream_pool_tokens))
    engine.warm_up()
    return engine


def stream_metronome(cfg, sessions: int, policy: str, log: Log, native: bool = False) -> dict:
    """Metronome under the beat (wall clock) on vLLM, or on the native engine (`native`)."""
    from metronome.model.weights import load_tokenizer
    from metronome.runtime.frame import FrameStatus
    from metronome.runtime.observer import RuntimeObserver
    from metronome.runtime.ports import Listeners
    from metronome.runtime.profile import SessionProfile
    from metronome.runtime.wall import WallDriver
    from metronome.sim.local import text_source
    from metronome.sim.recorder import RunRecorder
    from metronome.sim.workload import schedule

    bound = ResidencyPolicy.parse(policy)
    engine = _native_engine(cfg) if native else _stream_engine(cfg, sessions, bound)
    vocab_size = engine.model.config.vocab_size if native else engine.vocab_size
    recorder = RunRecorder()
    observer = RuntimeObserver.create(engine.config.block_size if native else cfg.block_size,
                                      health_window_s=HEALTH_WINDOW_S)
    health: list[tuple[float, str]] = []
    stopped: list[float] = []

    async def drive() -> _SentFrames:
        driver = WallDriver(engine, Listeners.of(recorder, observer))
        sent = _SentFrames(driver.beat)
        workload = _workload(cfg, sessions)
        profile = SessionProfile(frame_period_s=cfg.stream_period_s,
                                 max_output_tokens_per_frame=cfg.stream_tokens_out,
                                 policy=bound)
        schedule(workload, profile, sent, driver.timer,
                 text_source(load_tokenizer(), vocab_size, cfg.stream_tokens_in))
        last = 0.0
        try:
            while (now := driver.now_s()) < workload.end_s + 2 * cfg.stream_period_s:
                await asyncio.sleep(0.5)
                health.append((now, observer.health_summary(now)["state"]))
                if now - last >= 10:
                    last = now
                    s = recorder.summary()
                    log(f"  metronome {policy} t={now:5.0f} s: {s['frames']} frames, "
                        f"{s['frames_by_status']['stalled_kv']} stalled_kv, health "
                        f"{health[-1][1]}")
            stopped.append(driver.now_s())
        finally:
            driver.close()
        if driver.error:
            raise RuntimeError(f"engine thread failed: {driver.error}")
        return sent

    try:
        sent = asyncio.run(drive())
    finally:
        engine.shutdown()
    results = {(r.session_id, r.index): r for r in recorder.results}
    records = []
    for key, arrival_s in sent.arrival_s.items():
        r = results.get(key)
        complete = r is not None and r.status is FrameStatus.OK and (
            bool(r.token_ids) or not r.expects_output)
        records.append((arrival_s, None if r is None else r.finish_s, complete))
    summary = summarize_frames(records, cfg.stream_period_s, stopped[0])
    due = [r for r in recorder.results if r.arrival_s + cfg.stream_period_s <= stopped[0]]
    stalls = [r.arrival_s for r in due if r.status is FrameStatus.STALLED_KV]
    system = "native Metronome" if native else "Metronome on vLLM"
    return {"run": f"{system}, {policy}", "sessions": sessions, **summary,
            "first_stall_arrival_s": min(stalls, default=None),
            "stalled_kv_frames": len(stalls),
            "frames_by_status": {s.value: sum(r.status is s for r in due) for s in FrameStatus},
            "health_critical_first_s": next((t for t, h in health if h == "critical"), None),
            "peak_used_blocks": recorder.summary()["peak_used_blocks"]}



def run_arm(cfg, sessions: int, arm: str, log: Log = print) -> dict:
    """One arm of `STREAM_ARMS` at `sessions` sessions, in this process."""
    if arm in ("stock", "sliding_window"):
        return stream_stock(cfg, sessions, log, sliding_window=arm == "sliding_window")
    if arm in ("unbounded", "bounded"):
        return stream_metronome(cfg, sessions, "unbounded" if arm == "unbounded"
                                else str(cfg.bound), log)
    if arm == "native":
        return stream_metronome(cfg, sessions, str(cfg.bound), log, native=True)
    raise ValueError(f"unknown arm {arm!r}; known: {', '.join(STREAM_ARMS)}")


def _flushed_print(line: str) -> None:
    print(line, flush=True)


def _run_arm_logged(cfg, sessions: int, arm: str) -> dict:
    return run_arm(cfg, sessions, arm, _flushed_print)


def run_arm_isolated(cfg, sessions: int, arm: str) -> dict:
    """`run_arm` in a fresh (spawned) process: no engine, config or registry state of an
    earlier arm or engine in this process can carry over into this one."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_arm_logged, cfg, sessions, arm).result()
