"""`metronome bench vllm`'s step cells. At each context length L, one group of systems is
alive at a time (`Config.engine_groups`: stock vLLM alone, then vLLM's sliding window,
vLLM + the bound and the native engine together: the pools of all four at N = 64 would not
fit this machine's memory), each with the largest N sessions at L tokens; then `repeats`
rounds in which, at every N, each system of the group runs pure decode steps and chunk
steps (every session feeds `chunk_tokens` of real text, samples one), in an order that
rotates every round, so load from elsewhere hits all alike. A cell is the median over
rounds of each round's median step."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from metronome.bench.vllm.engines import native_engine, text_ids, vllm_engine
from metronome.bench.vllm.names import NATIVE, PLUGIN, SLIDING
from metronome.bench.vllm.steps import chunk_steps, decode_steps, prefill, set_threads
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy

KINDS = ("decode", "chunk")


def _tokens_added(cfg, sessions: int) -> int:
    """Tokens each of the first sessions gains over every round: decode + chunk steps."""
    per_round = (cfg.decode_steps + 2) + cfg.chunk_steps * (cfg.chunk_tokens + 1)
    return per_round * sessions * cfg.repeats + 64


def _pool_tokens(cfg, kind: str, length: int, top: int, sessions: int) -> int:
    if kind in (PLUGIN, SLIDING):  # the window plus vLLM's in-flight reserve (a step's tokens)
        per_session = cfg.sink_tokens + cfg.window_tokens + cfg.max_step_tokens + 64
    elif kind == NATIVE:  # the window, a chunk and a block either side
        per_session = cfg.sink_tokens + cfg.window_tokens + cfg.chunk_tokens + 2 * cfg.block_size
    else:
        per_session = length + _tokens_added(cfg, sessions)
    return -(-top * per_session // cfg.block_size) * cfg.block_size


def _start(cfg, kind: str, model, length: int, top: int, sessions: int):
    pool = _pool_tokens(cfg, kind, length, top, sessions)
    budget = {"max_step_tokens": cfg.max_step_tokens,  # every system alike
              "max_chunk_tokens": min(512, cfg.max_step_tokens)}
    if kind == NATIVE:
        return native_engine(model, cfg.block_size, pool, **budget), pool
    return vllm_engine(kind, cfg.bound, cfg.block_size, max(cfg.sessions), pool,
                       max_len=length + _tokens_added(cfg, sessions) + 64, **budget), pool


def _cells_at(cfg, model, group: tuple[str, ...], length: int, log: Callable[[str], None]
              ) -> list[dict]:
    sessions = cfg.sessions_at(length)
    top = max(sessions)
    engines, sids, threads, info = {}, {}, {}, {}
    ids = text_ids(length * 2 + cfg.chunk_tokens)
    chunk = ids[-cfg.chunk_tokens:]
    try:
        for kind in group:
            started = time.perf_counter()
            if kind == NATIVE:
                set_threads(os.cpu_count() or 1)  # vLLM, if it started first, left 1
            engine, pool = _start(cfg, kind, model, length, top, len(sessions))
            engines[kind] = engine
            threads[kind] = (os.cpu_count() or 1) if kind == NATIVE else torch.get_num_threads()
            policy = cfg.bound if kind in (PLUGIN, NATIVE) else ResidencyPolicy.unbounded()
            spec = SessionSpec(policy=policy, stop_token_ids=())
            sids[kind] = [engine.open_session(spec) for _ in range(top)]
            start_s = time.perf_counter() - started
            set_threads(threads[kind])
            t0 = time.perf_counter()
            if kind == NATIVE:  # its own fast path: KV written without the model
                for sid in sids[kind]:
                    assert engine.fast_forward(sid, length), "pool sized too small"
            else:
                prefill(engine, sids[kind], length, ids)
            info[kind] = {"engine_start_s": start_s, "prefill_s": time.perf_counter() - t0,
                          "pool_tokens": pool}
            log(f"  {kind} L={length:,}: pool {pool:,} tokens, {top} sessions at L in "
                f"{info[kind]['prefill_s']:.0f} s")
        times = {(k, kind, n): [] for k in engines for kind in KINDS for n in sessions}
        order = list(engines)
        for rnd in range(cfg.repeats):
            turn = order[rnd % len(order):] + order[:rnd % len(order)]
            for n in sessions:
                for k in turn:
                    e, s = engines[k], sids[k][:n]
                    times[(k, "decode", n)].append(decode_steps(e, s, cfg.decode_steps,
                                                                threads[k]))
                    times[(k, "chunk", n)].append(chunk_steps(e, s, cfg.chunk_steps, chunk,
                                                              threads[k]))
                for kind in KINDS:
                    line = "  ".join(f"{k} {statistics.median(times[(k, kind, n)][-1]):7.1f}"
                                     for k in order)
                    log(f"  round {rnd + 1}/{cfg.repeats} L={length:,} N={n:3d} {kind:6s} "
                        f"ms/step: {line}")
        cells = []
        for (k, kind, n), rounds in times.items():
            medians = [statistics.median(r) for r in rounds]
            median_ms = statistics.median(medians)
            rows = n * (1 if kind == "decode" else cfg.chunk_tokens)
            resident = sum(engines[k].resident_tokens_by_session()[sid] for sid in sids[k][:n])
            cells.append({"engine": k, "step": kind, "sessions": n, "context_tokens": length,
                          "step_ms_median": median_ms, "round_medians_ms": medians,
                          "step_ms_min": min(min(r) for r in rounds),
                          "input_tokens_per_step": rows,
                          "tokens_per_s": rows / median_ms * 1e3,
                          "resident_kv_tokens_after": resident,
                          "torch_threads": set_threads(threads[k]), **info[k]})
        return cells
    finally:
        for engine in engines.values():
            engine.shutdown()


def decode_grid(cfg, model, log: Callable[[str], None]) -> list[dict]:
    """Decode and chunk cells at every L of `cfg.lengths`, group by group."""
    cells = []
    for length in cfg.lengths:
        for group in cfg.groups:
            if cfg.sessions_at(length):
                cells += _cells_at(cfg, model, group, length, log)
    return cells
