"""`metronome bench engine-vs-vllm`: the native engine against vLLM on the same CPU, side by side.

Two pairs, each measured together in one process: our engine unbounded vs stock vLLM (full
attention), and our engine under `sinks_window:S:W` vs vLLM's own sliding window of S + W
tokens (the same resident KV). For each context length L, one engine of each system of a
pair is alive at once:

* **prefill**: each prefills `prefill_sessions` sessions of L tokens of real text (Hamlet),
  timed; vLLM then prefills the rest of the largest N (it has no other way to a long
  context), ours lengthens them with `Engine.fast_forward` (same blocks, same step cost);
* **decode**: `repeats` rounds; in each, at every N, both systems run `decode_steps` pure
  decode steps (every one of the first N sessions decoding one token), in alternating order
  (ours first in even rounds, vLLM first in odd), so load from elsewhere hits both alike.
  A cell reports the median over rounds of each round's median step, and the fastest step.

Then the projections' matmul peak: torch's own best GFLOP/s (F.linear and prepacked oneDNN)
for the decode step's GEMM shapes at each N, against what our step reaches in its GEMMs
(a profiled step's oneDNN time). Writes JSON, a markdown report and a plot. Needs vLLM
(`make vllm-install`; run from .venv-vllm).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console

from metronome.bench.engine.flops import linear_weights
from metronome.bench.vllm_bench import SLIDING, STOCK, VllmBenchConfig, _text_ids, _vllm_engine
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy

OURS = "metronome"


@dataclass(frozen=True)
class EngineVsVllmConfig:
    sessions: tuple[int, ...] = (8, 32, 64)
    lengths: tuple[int, ...] = (1024, 4096)
    sink_tokens: int = 4
    window_tokens: int = 512
    # vLLM prefills every session for real (~430 tokens/s here, fp32): cells with N x L over
    # this are skipped (32 x 4k would add ~10 min per vLLM engine)
    max_prefill_tokens: int = 65536
    prefill_sessions: int = 8  # prefilled for real by both systems, timed
    decode_steps: int = 6
    repeats: int = 3
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32; ours uses the same
    max_chunk_tokens: int = 512  # both systems' prefill chunk and step budget
    max_step_tokens: int = 2048
    out_md: str = "docs/results/engine_vs_vllm.md"
    out_json: str = "docs/results/engine_vs_vllm.json"

    @classmethod
    def smoke(cls, **kw) -> EngineVsVllmConfig:
        return cls(sessions=(2, 4), lengths=(256,), window_tokens=64, decode_steps=3,
                   repeats=2, prefill_sessions=2, **kw)

    @property
    def bound(self) -> ResidencyPolicy:
        return ResidencyPolicy.sinks_window(self.sink_tokens, self.window_tokens)

    def sessions_at(self, length: int) -> tuple[int, ...]:
        return tuple(n for n in self.sessions if n * length <= self.max_prefill_tokens)

    def vllm_config(self) -> VllmBenchConfig:
        return VllmBenchConfig(sessions=self.sessions, lengths=self.lengths,
                               sink_tokens=self.sink_tokens, window_tokens=self.window_tokens,
                               block_size=self.block_size)


def _ours(cfg: EngineVsVllmConfig, model, policy: ResidencyPolicy, pool_tokens: int):
    from metronome.engine.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(block_size=cfg.block_size, pool_tokens=pool_tokens,
                                      max_chunk_tokens=cfg.max_chunk_tokens,
                                      max_step_tokens=cfg.max_step_tokens))


def _threads(wanted: int) -> int:
    """Set torch's threads if they differ (vLLM's CPU worker replaces set_num_threads with a
    warning after it binds its threads); returns the count in effect."""
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return torch.get_num_threads()


def _prefill(engine, sids: list[int], length: int, ids: list[int]) -> float:
    started = time.perf_counter()
    for k, sid in enumerate(sids):
        offset = (k * 997) % length
        engine.submit_prepared(sid, engine.prepare_input(ids[offset:offset + length], None), 0)
    while engine.has_work:
        engine.step()
    return time.perf_counter() - started


def _decode_steps(engine, sids: list[int], steps: int, threads: int) -> list[float]:
    """Pure decode steps of these sessions (each feeds one token, samples one): step ms."""
    _threads(threads)
    for sid in sids:
        engine.submit_prepared(sid, engine.prepare_input([13], None), steps + 1)
    times = []
    while engine.has_work:
        t0 = time.perf_counter()
        result = engine.step()
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        if result.num_input_tokens == len(sids):
            times.append(elapsed_ms)
    return times[1:] or times  # the first step of a batch warms it up


def _pair(cfg: EngineVsVllmConfig, model, length: int, ours_policy: ResidencyPolicy,
          vllm_kind: str, console: Console) -> list[dict]:
    sessions = cfg.sessions_at(length)
    top = max(sessions)
    decode_tokens = cfg.decode_steps * len(sessions) * cfg.repeats * 2 + 64
    if ours_policy.bounded:  # the window plus vLLM's in-flight reserve
        per_session = cfg.sink_tokens + cfg.window_tokens + 2048 + 64
    else:
        per_session = length + decode_tokens
    pool = -(-top * per_session // cfg.block_size) * cfg.block_size
    label = f"L={length:,} {ours_policy} vs {vllm_kind}"
    console.print(f"[bold]{label}[/]: KV pool {pool:,} tokens each, N up to {top}")
    started = time.perf_counter()
    vllm = _vllm_engine(vllm_kind, cfg.vllm_config(), pool,
                        max_len=length + max(1024, decode_tokens + 64))
    vllm_start_s = time.perf_counter() - started
    vllm_threads = torch.get_num_threads()
    ours_threads = os.cpu_count() or 1
    ours = _ours(cfg, model, ours_policy, pool)
    engines = {OURS: ours, vllm_kind: vllm}
    threads = {OURS: ours_threads, vllm_kind: vllm_threads}
    specs = {OURS: SessionSpec(policy=ours_policy, stop_token_ids=()),
             vllm_kind: SessionSpec(policy=ResidencyPolicy.unbounded(), stop_token_ids=())}
    sids = {name: [e.open_session(specs[name]) for _ in range(top)] for name, e in engines.items()}
    ids = _text_ids(length * 2)
    prefill_s = {}
    try:
        for name in (OURS, vllm_kind):
            _threads(threads[name])
            prefill_s[name] = _prefill(engines[name], sids[name][:cfg.prefill_sessions], length,
                                       ids)
            console.print(f"  prefill {cfg.prefill_sessions} x {length:,}: {name} "
                          f"{prefill_s[name]:.1f} s")
        for sid in sids[OURS][cfg.prefill_sessions:]:
            assert ours.fast_forward(sid, length), "pool sized too small"
        rest = sids[vllm_kind][cfg.prefill_sessions:]
        if rest:
            console.print(f"  vLLM prefills the other {len(rest)} sessions (untimed)...")
            _prefill(vllm, rest, length, ids)
        steps = {(name, n): [] for name in engines for n in sessions}
        for rnd in range(cfg.repeats):
            order = (OURS, vllm_kind) if rnd % 2 == 0 else (vllm_kind, OURS)
            for n in sessions:
                for name in order:
                    times = _decode_steps(engines[name], sids[name][:n], cfg.decode_steps,
                                          threads[name])
                    steps[(name, n)].append(times)
                line = "  ".join(f"{name} {statistics.median(steps[(name, n)][-1]):7.1f}"
                                 for name in (OURS, vllm_kind))
                console.print(f"  round {rnd + 1}/{cfg.repeats} N={n:3d}: ms/step {line}")
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
                          "prefill_s": prefill_s[name], "prefill_sessions": cfg.prefill_sessions,
                          "torch_threads": _threads(threads[name]),
                          "vllm_start_s": vllm_start_s})
        if length == min(cfg.lengths):  # GEMMs do not depend on L: measure them once per N
            for cell in cells:
                if cell["system"] == OURS:
                    cell["gemm"] = gemm_efficiency(ours, sids[OURS][:cell["sessions"]],
                                                   model, ours_threads)
        return cells
    finally:
        vllm.shutdown()
        for sid in sids[OURS]:
            ours.close(sid)


def gemm_peak_gflops(model, rows: int, repeats: int = 5) -> dict:
    """torch's best throughput for the step's projection shapes at `rows` rows: F.linear on
    the plain weights and oneDNN on prepacked ones, all layers in a row (weights from memory,
    as in a step), best of `repeats`."""
    from metronome.model.linear import Projection

    weights = linear_weights(model)[:-1]  # the projections (lm_head last, left out)
    flops = 2 * rows * sum(w.numel() for w in weights)
    out = {}
    for name, packed in (("f_linear", False), ("onednn_prepacked", True)):
        projections = [Projection(w, None, packed) for w in weights]
        inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]
        best = float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for p, x in zip(projections, inputs, strict=True):
                p(x)
            best = min(best, time.perf_counter() - t0)
        out[name] = flops / best / 1e9
    return out


def gemm_efficiency(engine, sids: list[int], model, threads: int) -> dict:
    """Our decode step's GEMM throughput (profiled oneDNN time of the projections, lm_head
    left out) against torch's peak for the same shapes."""
    from metronome.bench.engine.profiling import profile_steps

    _threads(threads)
    rows = len(sids)
    for sid in sids:
        engine.submit_prepared(sid, engine.prepare_input([13], None), 4)
    engine.step()  # warm
    prof = profile_steps(engine.step, 2)
    while engine.has_work:
        engine.step()
    gemm_ms = prof["aten_ms"]["matmul"]
    flops = 2 * rows * sum(w.numel() for w in linear_weights(model))  # lm_head included
    achieved = flops / (gemm_ms / 1e3) / 1e9 if gemm_ms else None
    peak = gemm_peak_gflops(model, rows)
    best = max(peak.values())
    return {"rows": rows, "step_gemm_ms": gemm_ms, "step_wall_ms": prof["wall_ms"],
            "achieved_gflops": achieved, "peak_gflops": peak,
            "share_of_peak": achieved / best if achieved else None,
            "profile": prof}


def run(cfg: EngineVsVllmConfig, console: Console | None = None) -> dict:
    from metronome.bench.engine.machine import machine
    from metronome.model import native
    from metronome.model.weights import load_model

    console = console or Console(stderr=True)
    started = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model("bundled", torch.float32)
    if native.kernel() is None:
        console.print(f"[yellow]paged kernel unavailable ({native.unavailable_reason()}): "
                      "ours runs its dense path[/]")
    partial = Path(cfg.out_json).with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    cells = []
    for length in cfg.lengths:
        if not cfg.sessions_at(length):
            continue
        for ours_policy, vllm_kind in ((ResidencyPolicy.unbounded(), STOCK),
                                       (cfg.bound, SLIDING)):
            cells += _pair(cfg, model, length, ours_policy, vllm_kind, console)
            partial.write_text(json.dumps({"cells": cells}, indent=2, default=str))
    import vllm

    facts = machine(os.environ.get("OMP_WAIT_POLICY", "unset")) | {
        "vllm": vllm.__version__, "paged_kernel": native.kernel() is not None,
        "packed_linear": model.packed_linear}
    result = {"config": asdict(cfg), "machine": facts, "cells": cells,
              "elapsed_s": time.perf_counter() - started}
    Path(cfg.out_json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    partial.unlink(missing_ok=True)
    from metronome.bench.engine_vs_vllm_report import write_report

    write_report(result, Path(cfg.out_md))
    console.print(f"wrote {cfg.out_md}, {cfg.out_json} ({result['elapsed_s'] / 60:.1f} min)")
    return result
