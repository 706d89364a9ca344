"""`metronome bench engine-vs-vllm`'s measurement: one native engine and one vLLM engine
alive together at one context length, both prefilling the same real text (timed), then
rounds of pure decode steps at each N in alternating order; and our decode step's GEMMs
against torch's peak for the same shapes."""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable

import torch

from metronome.bench.engine.floor import BandwidthProbe, decode_step_weights, weight_bytes
from metronome.bench.engine.flops import linear_weights
from metronome.bench.engine.profiling import profile_steps
from metronome.bench.vllm.engines import native_engine, text_ids, vllm_engine
from metronome.bench.vllm.names import OURS
from metronome.bench.vllm.steps import decode_steps, prefill, set_threads
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy


def _pool_tokens(cfg, length: int, policy: ResidencyPolicy, top: int, sessions: int) -> int:
    decode_tokens = cfg.decode_steps * sessions * cfg.repeats * 2 + 64
    if policy.bounded:  # the window plus vLLM's in-flight reserve: what one step may prefill
        # of the session, its step budget or its whole context if shorter (a smaller pool
        # makes vLLM preempt and recompute its long prefills over and over; a larger one
        # only takes memory: at N = 64 x 1k in float32 two pools sized by the step budget
        # alone were 26 GiB)
        per_session = cfg.sink_tokens + cfg.window_tokens + min(
            length, cfg.budgets()["vllm"]["max_step_tokens"]) + 64
    else:
        per_session = length + decode_tokens
    return -(-top * per_session // cfg.block_size) * cfg.block_size


# what the two engines need beside their KV pools: torch, vLLM and their working buffers
PROCESS_HEADROOM_BYTES = 2 << 30


def pairs_needing_too_much(cfg, model, available_bytes: int) -> list[str]:
    """The pairs of the grid whose memory (both engines' KV pools, the same size each, in the
    model's dtype; both copies of the weights; `PROCESS_HEADROOM_BYTES`) is over
    `available_bytes`, as lines saying so: vLLM allocates its whole pool when it starts, and
    a pair that does not fit ends the run in the kernel's OOM killer, without a word."""
    weights = 2 * weight_bytes(model)  # ours and vLLM's copy
    per_token = model.config.kv_bytes_per_token(model.dtype)
    lines = []
    for length in cfg.lengths:
        sessions = cfg.sessions_at(length)
        if not sessions:
            continue
        for policy in (ResidencyPolicy.unbounded(), cfg.bound):
            pool = _pool_tokens(cfg, length, policy, max(sessions), len(sessions))
            need = 2 * pool * per_token + weights + PROCESS_HEADROOM_BYTES
            if need > available_bytes:
                lines.append(f"L={length:,} {policy} at N={max(sessions)}: two KV pools of "
                             f"{pool:,} tokens in {str(model.dtype).removeprefix('torch.')} "
                             f"and the weights need {need / 2**30:.1f} GiB, "
                             f"{available_bytes / 2**30:.1f} GiB is available")
    return lines


def measure_pair(cfg, model, length: int, ours_policy: ResidencyPolicy, vllm_kind: str,
                 log: Callable[[str], None]) -> list[dict]:
    """Both systems at one L: prefill (timed), then `cfg.repeats` alternating rounds of
    decode steps at every N; one cell per system and N. GEMMs once per N (at the smallest
    L: they do not depend on L)."""
    sessions = cfg.sessions_at(length)
    top = max(sessions)
    pool = _pool_tokens(cfg, length, ours_policy, top, len(sessions))
    decode_tokens = cfg.decode_steps * len(sessions) * cfg.repeats * 2 + 64
    log(f"[bold]L={length:,} {ours_policy} vs {vllm_kind}[/]: KV pool {pool:,} tokens each, "
        f"N up to {top}")
    started = time.perf_counter()
    max_len = length + max(1024, decode_tokens + 64)
    budget = cfg.budgets()["vllm"]
    budget["max_chunk_tokens"] = min(budget["max_chunk_tokens"], max_len)  # vLLM's rule
    vllm = vllm_engine(vllm_kind, cfg.bound, cfg.block_size, max(cfg.sessions), pool,
                       max_len=max_len, **budget)
    vllm_start_s = time.perf_counter() - started
    threads = {vllm_kind: torch.get_num_threads(), OURS: os.cpu_count() or 1}
    ours = native_engine(model, cfg.block_size, pool, **cfg.budgets()["ours"])
    engines = {OURS: ours, vllm_kind: vllm}
    specs = {OURS: SessionSpec(policy=ours_policy, stop_token_ids=()),
             vllm_kind: SessionSpec(policy=ResidencyPolicy.unbounded(), stop_token_ids=())}
    sids = {name: [e.open_session(specs[name]) for _ in range(top)] for name, e in engines.items()}
    ids = text_ids(length * 2)
    probe = BandwidthProbe(decode_step_weights(model))  # the pages the step reads
    try:
        prefill_runs_s = _timed_prefills(cfg, engines, sids, specs, threads, length, ids, log)
        prefill_s = {name: statistics.median(runs) for name, runs in prefill_runs_s.items()}
        for sid in sids[OURS][cfg.prefill_sessions:]:
            assert ours.fast_forward(sid, length), "pool sized too small"
        rest = sids[vllm_kind][cfg.prefill_sessions:]
        if rest:
            log(f"  vLLM prefills the other {len(rest)} sessions (untimed)...")
            prefill(vllm, rest, length, ids)
        steps = {(name, n): [] for name in engines for n in sessions}
        bandwidth = {n: [] for n in sessions}  # GB/s next to each of our rounds
        for rnd in range(cfg.repeats):
            order = (OURS, vllm_kind) if rnd % 2 == 0 else (vllm_kind, OURS)
            for n in sessions:
                for name in order:
                    if name == OURS:
                        before = _bandwidth_gbs(probe, threads[OURS])
                    steps[(name, n)].append(decode_steps(engines[name], sids[name][:n],
                                                          cfg.decode_steps, threads[name]))
                    if name == OURS:  # the better of just before and just after: the floor
                        # it gives is the lower, the multiple the higher (never flattering)
                        bandwidth[n].append(max(before, _bandwidth_gbs(probe, threads[OURS])))
                line = "  ".join(f"{name} {statistics.median(steps[(name, n)][-1]):7.1f}"
                                 for name in (OURS, vllm_kind))
                log(f"  round {rnd + 1}/{cfg.repeats} N={n:3d}: ms/step {line}")
        cells = []
        for (name, n), rounds in steps.items():
            medians = [statistics.median(r) for r in rounds]
            median_ms = statistics.median(medians)
            cells.append({"system": name, "pair": vllm_kind, "policy":
                          str(ours_policy) if name == OURS else vllm_kind,
                          "sessions": n, "context_tokens": length,
                          "step_ms_median": median_ms, "step_ms_min": min(min(r) for r in rounds),
                          "round_medians_ms": medians,
                          "decode_tokens_per_s": n / median_ms * 1e3,
                          "prefill_s": prefill_s[name], "prefill_runs_s": prefill_runs_s[name],
                          "prefill_sessions": cfg.prefill_sessions,
                          "torch_threads": set_threads(threads[name]),
                          "vllm_start_s": vllm_start_s}
                         | ({"round_bandwidth_gbs": bandwidth[n]} if name == OURS else {}))
        if length == min(cfg.lengths):  # GEMMs do not depend on L: measure them once per N
            for cell in cells:
                if cell["system"] == OURS:
                    cell["gemm"] = gemm_efficiency(ours, sids[OURS][:cell["sessions"]],
                                                   model, threads[OURS])
        return cells
    finally:
        vllm.shutdown()
        for sid in sids[OURS]:
            ours.close(sid)


def _bandwidth_gbs(probe: BandwidthProbe, threads: int) -> float:
    set_threads(threads)
    return probe.gbs(repeats=3)


def _timed_prefills(cfg, engines: dict, sids: dict, specs: dict, threads: dict, length: int,
                    ids: list[int], log: Callable[[str], None]) -> dict[str, list[float]]:
    """`cfg.prefill_repeats` timed prefills of `cfg.prefill_sessions` sessions per system, in
    alternating order (ours first in even repeats): every repeat but the last on fresh
    sessions closed after it, the last on the first of `sids` (kept for decode). Seconds per
    repeat, per system."""
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(cfg.prefill_repeats):
        last = rep == cfg.prefill_repeats - 1
        order = list(engines) if rep % 2 == 0 else list(reversed(engines))
        for name in order:
            engine = engines[name]
            targets = (sids[name][:cfg.prefill_sessions] if last else
                       [engine.open_session(specs[name]) for _ in range(cfg.prefill_sessions)])
            set_threads(threads[name])
            runs[name].append(prefill(engine, targets, length, ids))
            if not last:
                for sid in targets:
                    engine.close(sid)
            log(f"  prefill {cfg.prefill_sessions} x {length:,} ({rep + 1}/"
                f"{cfg.prefill_repeats}): {name} {runs[name][-1]:.1f} s")
    return runs


def gemm_peak_gflops(model, rows: int, repeats: int = 5, past_limit: bool = False) -> dict:
    """torch's best throughput for the step's GEMM shapes at `rows` rows (every weight of
    `linear_weights`: the projections and lm_head), with F.linear on the plain weights and
    oneDNN on prepacked ones, all in a row (weights from memory, as in a step), best of
    `repeats` after one warm-up; and our few-row kernel where it applies (`small_linear`:
    at most `small_rows_max(dtype)` rows; bf16 on an AVX512-BF16 CPU, float32 on AVX2 with FMA;
    `past_limit`: at any row count, to find where it stops paying, `scripts/few_rows.py`)."""
    from metronome.model.linear import Projection, small_rows_max

    weights = linear_weights(model)
    flops = 2 * rows * sum(w.numel() for w in weights)
    plain = [Projection(w, None, False) for w in weights]
    packed = [Projection(w, None, True) for w in weights]
    ways = {"f_linear": plain, "onednn_prepacked": [p.onednn for p in packed]}
    if all(p.small is not None for p in packed):
        if rows <= small_rows_max(model.dtype):
            ways["small_linear"] = packed  # (Projection's own choice at these rows)
        elif past_limit:
            ways["small_linear"] = [functools.partial(p.small.small_linear, w=p.small_weight,
                                                      bias=None, out_features=p.out_features)
                                    for p in packed]
    inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]
    out = {}
    for name, products in ways.items():
        best = float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for product, x in zip(products, inputs, strict=True):
                product(x)
            best = min(best, time.perf_counter() - t0)
        out[name] = flops / best / 1e9
    return out


def gemm_efficiency(engine, sids: list[int], model, threads: int) -> dict:
    """Our decode step's GEMM throughput against torch's peak, both over the same weights
    (`linear_weights`: the projections and lm_head): the step's FLOPs in them over the
    profiled time of its GEMMs (the profile's matmul kind, which holds exactly those)."""
    set_threads(threads)
    rows = len(sids)
    for sid in sids:
        engine.submit_prepared(sid, engine.prepare_input([13], None), 4)
    engine.step()  # warm
    prof = profile_steps(engine.step, 2)
    while engine.has_work:
        engine.step()
    gemm_ms = prof["aten_ms"]["matmul"]
    flops = 2 * rows * sum(w.numel() for w in linear_weights(model))
    achieved = flops / (gemm_ms / 1e3) / 1e9 if gemm_ms else None
    peak = gemm_peak_gflops(model, rows)
    best = max(peak.values())
    return {"rows": rows, "step_gemm_ms": gemm_ms, "step_wall_ms": prof["wall_ms"],
            "achieved_gflops": achieved, "peak_gflops": peak,
            "share_of_peak": achieved / best if achieved else None,
            "profile": prof}
