"""`metronome bench vllm`: Metronome's bound inside vLLM, side by side in one run.

1. **Decode steps** at N sessions x L tokens of context: stock vLLM (full attention), vLLM
   with its own plain sliding window (`layer_types` = sliding, W + S tokens: the same
   resident KV), vLLM + the Metronome bound (`sinks_window:S:W`, the plugin) and the native
   engine with the same bound. Each engine prefills the largest N sessions to L once, then
   times pure decode steps (every one of the first N sessions decoding) at each N.
2. **The streaming workload**: 16 sessions of 16 input + 4 output tokens per 1 s frame in a
   KV pool of 26,880 tokens. Stock vLLM (its scheduler alone: a session's next chunk goes in
   when its last one is done, as `AsyncLLM`'s streaming input does) against Metronome on
   vLLM (the beat and its deadlines) unbounded and bounded.

Everything runs in one process, one engine at a time (vLLM in-process; CPU threads are the
machine's). Writes JSON, a markdown report and a plot. Needs vLLM (`make vllm-install`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy

STOCK, SLIDING, PLUGIN, NATIVE = "vllm", "vllm_sliding_window", "vllm_metronome", "native"
ENGINES = (STOCK, SLIDING, PLUGIN, NATIVE)
HEALTH_WINDOW_S = 2.0  # health over the last control interval, as metronome serve has it


@dataclass(frozen=True)
class VllmBenchConfig:
    sessions: tuple[int, ...] = (8, 32, 64)
    lengths: tuple[int, ...] = (1024, 4096)
    sink_tokens: int = 4
    window_tokens: int = 512
    # Prefill is compute-bound on a CPU (~430 tokens/s here: 0.27 GFLOP a token): cells
    # whose N x L exceeds this are skipped (64 x 4k would take ~10 min per engine)
    max_prefill_tokens: int = 65536
    decode_steps: int = 8  # timed per cell (the median is reported)
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32
    engines: tuple[str, ...] = (NATIVE, STOCK, SLIDING, PLUGIN)  # native first: vLLM sets
    # torch's threads to 1 in its process (the native engine gets them back, and says so)
    # The workload is 16 sessions in 26,880 tokens. On this 2-core CPU (fp32) vLLM
    # answers 8 such sessions at p50 1.5 s already (measured): a quarter of the sessions
    # in a quarter of the pool, the same fill time (~84 s), a load the machine can serve.
    stream_sessions: int = 4
    stream_duration_s: float = 200.0
    stream_period_s: float = 1.0
    stream_tokens_in: int = 16
    stream_tokens_out: int = 4
    stream_pool_tokens: int = 6720
    out_md: str = "docs/results/vllm.md"
    out_json: str = "docs/results/vllm.json"
    notes: list[str] = field(default_factory=list)

    @property
    def bound(self) -> ResidencyPolicy:
        return ResidencyPolicy.parse(f"sinks_window:{self.sink_tokens}:{self.window_tokens}")

    @classmethod
    def smoke(cls, **kw) -> VllmBenchConfig:
        return cls(sessions=(2, 4), lengths=(256,), window_tokens=64, decode_steps=3,
                   stream_sessions=4, stream_duration_s=12.0, stream_pool_tokens=1024, **kw)

    def sessions_at(self, length: int) -> tuple[int, ...]:
        return tuple(n for n in self.sessions if n * length <= self.max_prefill_tokens)


# ---- 1. decode steps ------------------------------------------------------------------------
def _vllm_engine(kind: str, cfg: VllmBenchConfig, pool_tokens: int, max_len: int):
    from metronome.model.weights import bundled_model_dir
    from metronome.vllm.engine import VllmEngine, VllmEngineConfig

    model_dir = str(bundled_model_dir())
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    policy, overrides = ResidencyPolicy.unbounded(), None
    if kind == PLUGIN:
        policy = cfg.bound
    elif kind == SLIDING:
        overrides = {"layer_types": ["sliding_attention"] * layers,
                     "sliding_window": cfg.sink_tokens + cfg.window_tokens}
    return VllmEngine.start(VllmEngineConfig(
        model_dir=model_dir, policy=policy, pool_tokens=pool_tokens,
        block_size=cfg.block_size, max_model_len=max_len, max_num_seqs=max(cfg.sessions),
        max_step_tokens=2048, max_chunk_tokens=512, hf_overrides=overrides))


def _native_engine(cfg: VllmBenchConfig, pool_tokens: int):
    import os

    from metronome.engine.engine import Engine, EngineConfig
    from metronome.model.weights import load_model

    torch.set_num_threads(os.cpu_count() or 1)  # vLLM, if it ran first, left it at 1
    return Engine(load_model("bundled", torch.float32),
                  EngineConfig(block_size=cfg.block_size, pool_tokens=pool_tokens))


def _text_ids(count: int) -> list[int]:
    from metronome.corpus import play_text
    from metronome.model.weights import load_tokenizer

    ids = load_tokenizer().encode(play_text("hamlet")).ids
    while len(ids) < count:
        ids = ids + ids
    return ids


def _decode_cells(engine, kind: str, cfg: VllmBenchConfig, length: int, console) -> list[dict]:
    """Prefill max(N) sessions to `length`, then time decode steps at each N."""
    sessions = cfg.sessions_at(length)
    policy = cfg.bound if kind in (PLUGIN, NATIVE) else ResidencyPolicy.unbounded()
    spec = SessionSpec(policy=policy, stop_token_ids=())
    sids = [engine.open_session(spec) for _ in range(max(sessions))]
    started = time.perf_counter()
    if kind == NATIVE:  # its own fast path: KV written without the model (same step cost)
        for sid in sids:
            engine.fast_forward(sid, length)
    else:
        ids = _text_ids(length * 2)
        for k, sid in enumerate(sids):
            offset = (k * 997) % length
            engine.submit_prepared(sid, engine.prepare_input(ids[offset:offset + length],
                                                             None), 0)
        while engine.has_work:
            engine.step()
    prefill_s = time.perf_counter() - started
    cells = []
    for n in sessions:
        for sid in sids[:n]:
            engine.submit_prepared(sid, engine.prepare_input([13], None), cfg.decode_steps + 2)
        step_ms = []
        while engine.has_work:
            t0 = time.perf_counter()
            result = engine.step()
            elapsed_ms = (time.perf_counter() - t0) * 1e3
            if result.num_input_tokens == n and all(len(s.new_token_ids) == 1 or s.generating
                                                    for s in result.sessions):
                step_ms.append(elapsed_ms)
        steady = sorted(step_ms[1:]) or step_ms  # the first decode step warms the batch up
        median_ms = statistics.median(steady)
        resident = sum(engine.resident_tokens_by_session()[sid] for sid in sids[:n])
        cells.append({"engine": kind, "sessions": n, "context_tokens": length,
                      "step_ms_median": median_ms, "step_ms_min": min(steady),
                      "decode_tokens_per_s": n / median_ms * 1e3, "timed_steps": len(steady),
                      "resident_kv_tokens": resident, "prefill_s": prefill_s,
                      "torch_threads": torch.get_num_threads()})
        console.print(f"  {kind:22s} N={n:3d} L={length:5d}: {median_ms:7.1f} ms/step "
                      f"({n / median_ms * 1e3:6.0f} tok/s), resident KV {resident:,}")
    for sid in sids:
        engine.close(sid)
    return cells


def decode_grid(cfg: VllmBenchConfig, console: Console) -> list[dict]:
    cells = []
    for kind in cfg.engines:
        for length in cfg.lengths:
            sessions = max(cfg.sessions_at(length), default=0)
            if not sessions:
                continue
            per_session = length + cfg.decode_steps * len(cfg.sessions) * 4 + 64
            pool = sessions * per_session
            if kind in (PLUGIN, NATIVE, SLIDING):  # the window plus vLLM's in-flight reserve
                pool = sessions * (cfg.sink_tokens + cfg.window_tokens + 2048 + 64)
            pool = -(-pool // cfg.block_size) * cfg.block_size
            console.print(f"[bold]{kind}[/] L={length}: KV pool {pool:,} tokens")
            started = time.perf_counter()
            if kind == NATIVE:
                engine = _native_engine(cfg, pool)
            else:
                engine = _vllm_engine(kind, cfg, pool, max_len=length + 1024)
            start_s = time.perf_counter() - started
            try:
                for cell in _decode_cells(engine, kind, cfg, length, console):
                    cells.append(cell | {"engine_start_s": start_s})
            finally:
                engine.shutdown()
    return cells


# ---- 2. the streaming workload --------------------------------------------------------------
def stream_stock(cfg: VllmBenchConfig, console: Console) -> dict:
    """vLLM's scheduler alone: each session's frames go in FIFO as chunks of its one
    resumable request, the next when the last is done; a frame is answered when its chunk
    is. Nothing answers a frame the engine never gets to."""
    from metronome.model.weights import bundled_model_dir
    from metronome.vllm.engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine.start(VllmEngineConfig(
        model_dir=str(bundled_model_dir()), pool_tokens=cfg.stream_pool_tokens,
        block_size=cfg.block_size, max_model_len=8192, max_num_seqs=cfg.stream_sessions))
    ids = _text_ids(50_000)
    try:
        engine.warm_up()
        sids = [engine.open_session(SessionSpec(stop_token_ids=())) for _ in
                range(cfg.stream_sessions)]
        frames = {sid: [] for sid in sids}  # (arrival_s, answered_s | None)
        waiting = {sid: [] for sid in sids}
        running: dict[int, int] = {}  # session -> frame index in flight
        next_frame_s = [k * cfg.stream_period_s / cfg.stream_sessions
                        for k in range(cfg.stream_sessions)]
        t0 = time.perf_counter()
        last_report = 0.0
        while (now := time.perf_counter() - t0) < cfg.stream_duration_s:
            for k, sid in enumerate(sids):
                while next_frame_s[k] <= now:
                    index = len(frames[sid])
                    frames[sid].append([next_frame_s[k], None])
                    waiting[sid].append(index)
                    next_frame_s[k] += cfg.stream_period_s
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
                console.print(f"  stock t={now:5.0f} s: {answered}/{total} frames answered, "
                              f"pool {engine.pool_stats().used_blocks}/{engine.num_blocks}")
        pool = engine.pool_stats()
    finally:
        engine.shutdown()
    deadline_s = cfg.stream_period_s
    rows = [f for per in frames.values() for f in per]
    answered = [f for f in rows if f[1] is not None]
    on_time = [f for f in answered if f[1] - f[0] <= deadline_s]
    # frames that arrived early enough to have been answered by the end
    due = [f for f in rows if f[0] <= cfg.stream_duration_s - deadline_s]
    never = [f for f in due if f[1] is None]
    latencies_ms = sorted((f[1] - f[0]) * 1e3 for f in answered)
    return {"run": "stock vLLM", "frames": len(due), "never_answered": len(never),
            "first_unanswered_arrival_s": min((f[0] for f in never), default=None),
            "goodput": len([f for f in on_time if f in due]) / len(due) if due else None,
            "latency_ms_p50": _pct(latencies_ms, 50), "latency_ms_p95": _pct(latencies_ms, 95),
            "stalled_kv_frames": None, "final_used_blocks": pool.used_blocks,
            "num_blocks": pool.num_blocks}


def stream_metronome(cfg: VllmBenchConfig, policy: str, console: Console) -> dict:
    """Metronome on vLLM: the same workload under the beat (wall clock)."""
    from metronome.model.weights import bundled_model_dir, load_tokenizer
    from metronome.runtime.observer import RuntimeObserver
    from metronome.runtime.ports import Listeners
    from metronome.runtime.profile import SessionProfile
    from metronome.runtime.wall import WallDriver
    from metronome.sim.local import text_source
    from metronome.sim.recorder import RunRecorder
    from metronome.sim.workload import Workload, schedule
    from metronome.vllm.engine import VllmEngine, VllmEngineConfig

    bound = ResidencyPolicy.parse(policy)
    engine = VllmEngine.start(VllmEngineConfig(
        model_dir=str(bundled_model_dir()), policy=bound, pool_tokens=cfg.stream_pool_tokens,
        block_size=cfg.block_size, max_model_len=8192, max_num_seqs=cfg.stream_sessions))
    engine.warm_up()
    recorder = RunRecorder()
    observer = RuntimeObserver.create(cfg.block_size, health_window_s=HEALTH_WINDOW_S)
    health: list[tuple[float, str]] = []

    async def drive() -> None:
        driver = WallDriver(engine, Listeners.of(recorder, observer))
        workload = Workload(cfg.stream_sessions, cfg.stream_duration_s,
                            arrival_spread_s=cfg.stream_period_s)
        profile = SessionProfile(frame_period_s=cfg.stream_period_s,
                                 max_output_tokens_per_frame=cfg.stream_tokens_out,
                                 policy=bound)
        schedule(workload, profile, driver.beat, driver.timer,
                 text_source(load_tokenizer(), engine.vocab_size, cfg.stream_tokens_in))
        last = 0.0
        try:
            while (now := driver.now_s()) < workload.end_s + 2 * cfg.stream_period_s:
                await asyncio.sleep(0.5)
                health.append((now, observer.health_summary(now)["state"]))
                if now - last >= 10:
                    last = now
                    s = recorder.summary()
                    console.print(f"  metronome {policy} t={now:5.0f} s: {s['frames']} frames,"
                                  f" {s['frames_by_status']['stalled_kv']} stalled_kv, health "
                                  f"{health[-1][1]}")
        finally:
            driver.close()
        if driver.error:
            raise RuntimeError(f"engine thread failed: {driver.error}")

    try:
        asyncio.run(drive())
    finally:
        engine.shutdown()
    summary = recorder.summary()
    stalls = [r.arrival_s for r in recorder.results if r.status.value == "stalled_kv"]
    return {"run": f"Metronome on vLLM, {policy}", "frames": summary["frames"],
            "never_answered": 0,  # the beat answers every frame (the counts add up)
            "first_stall_arrival_s": min(stalls, default=None),
            "stalled_kv_frames": summary["frames_by_status"]["stalled_kv"],
            "goodput": summary["goodput"], "deadline_met": summary["deadline_met_fraction"],
            "latency_ms_p50": summary["latency_ms"]["p50"],
            "latency_ms_p95": summary["latency_ms"]["p95"],
            "frames_by_status": summary["frames_by_status"],
            "health_critical_first_s": next((t for t, h in health if h == "critical"), None),
            "peak_used_blocks": summary["peak_used_blocks"]}


def _pct(sorted_values: list[float], q: float) -> float | None:
    from metronome.stats import percentile

    return percentile(sorted_values, q)


# ---- the run --------------------------------------------------------------------------------
def run(cfg: VllmBenchConfig, console: Console | None = None) -> dict:
    import os

    from metronome.bench.engine.machine import machine

    console = console or Console(stderr=True)
    started = time.perf_counter()
    partial = Path(cfg.out_json).with_suffix(".partial.json")  # a crash keeps what ran
    partial.parent.mkdir(parents=True, exist_ok=True)
    console.rule("decode steps")
    cells = decode_grid(cfg, console)
    partial.write_text(json.dumps({"decode": cells}, indent=2, default=str))
    console.rule("streaming workload")
    stream = []
    for run_one in (lambda: stream_stock(cfg, console),
                    lambda: stream_metronome(cfg, "unbounded", console),
                    lambda: stream_metronome(cfg, str(cfg.bound), console)):
        stream.append(run_one())
        partial.write_text(json.dumps({"decode": cells, "stream": stream}, indent=2,
                                      default=str))
    import vllm

    facts = machine(os.environ.get("OMP_WAIT_POLICY", "unset")) | {"vllm": vllm.__version__}
    result = {"config": asdict(cfg), "machine": facts, "decode": cells,
              "stream": stream, "elapsed_s": time.perf_counter() - started}
    Path(cfg.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.out_json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    partial.unlink(missing_ok=True)
    from metronome.bench.vllm_report import write_report

    write_report(result, Path(cfg.out_md))
    return result
