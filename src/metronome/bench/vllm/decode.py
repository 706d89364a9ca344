"""`metronome bench vllm`'s decode cells: one engine at a time prefills the largest N
sessions to L once, then times pure decode steps (every one of the first N sessions
decoding one token) at each N."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from metronome.bench.vllm.engines import native_engine, text_ids, vllm_engine
from metronome.bench.vllm.names import NATIVE, PLUGIN, SLIDING
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy


def _prefill(engine, kind: str, sids: list[int], length: int) -> float:
    started = time.perf_counter()
    if kind == NATIVE:  # its own fast path: KV written without the model (same step cost)
        for sid in sids:
            engine.fast_forward(sid, length)
    else:
        ids = text_ids(length * 2)
        for k, sid in enumerate(sids):
            offset = (k * 997) % length
            engine.submit_prepared(sid, engine.prepare_input(ids[offset:offset + length],
                                                             None), 0)
        while engine.has_work:
            engine.step()
    return time.perf_counter() - started


def decode_cells(engine, kind: str, cfg, length: int, log: Callable[[str], None]) -> list[dict]:
    """Prefill max(N) sessions to `length`, then time decode steps at each N."""
    sessions = cfg.sessions_at(length)
    policy = cfg.bound if kind in (PLUGIN, NATIVE) else ResidencyPolicy.unbounded()
    spec = SessionSpec(policy=policy, stop_token_ids=())
    sids = [engine.open_session(spec) for _ in range(max(sessions))]
    prefill_s = _prefill(engine, kind, sids, length)
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
        log(f"  {kind:22s} N={n:3d} L={length:5d}: {median_ms:7.1f} ms/step "
            f"({n / median_ms * 1e3:6.0f} tok/s), resident KV {resident:,}")
    for sid in sids:
        engine.close(sid)
    return cells


def decode_grid(cfg, model, log: Callable[[str], None]) -> list[dict]:
    """Every engine of `cfg.engines` at every L, one engine alive at a time."""
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
            log(f"{kind} L={length}: KV pool {pool:,} tokens")
            started = time.perf_counter()
            if kind == NATIVE:
                torch.set_num_threads(os.cpu_count() or 1)  # vLLM, if it ran first, left 1
                engine = native_engine(model, cfg.block_size, pool)
            else:
                engine = vllm_engine(kind, cfg.bound, cfg.block_size, max(cfg.sessions), pool,
                                     max_len=length + 1024)
            start_s = time.perf_counter() - started
            try:
                for cell in decode_cells(engine, kind, cfg, length, log):
                    cells.append(cell | {"engine_start_s": start_s})
            finally:
                engine.shutdown()
    return cells
