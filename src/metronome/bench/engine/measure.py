"""Measuring configurations side by side: models per dtype, groups packed into the memory
budget, steps interleaved (see the package docstring), and the run's groups: the dtype
comparison, the (N, L) grid, and the bounded policy's flatness in L."""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from metronome.bench.engine.flops import add_flops, matmul_reference_ms
from metronome.bench.engine.hf import HfRun, load_hf
from metronome.bench.engine.ours import OursRun
from metronome.bench.engine.plan import HF_SYSTEM, KEY_FIELDS, Config, Key, label, progress
from metronome.bench.engine.timing import time_interleaved
from metronome.model.dtypes import DTYPES
from metronome.model.llama import LlamaModel
from metronome.model.weights import load_model


@dataclass
class Contender:
    key: Key
    kv_bytes: int
    start: Callable[[], OursRun | HfRun]


def packs(contenders: list[Contender], budget_bytes: int) -> list[list[Contender]]:
    """Split a side-by-side group, in order, into parts whose KV fits the budget together."""
    out: list[list[Contender]] = []
    for c in contenders:
        if out and sum(p.kv_bytes for p in out[-1]) + c.kv_bytes <= budget_bytes:
            out[-1].append(c)
        else:
            out.append([c])
    return out


class Bench:
    """Models per dtype; measures groups of configurations side by side."""

    def __init__(self, plan: Config) -> None:
        self.plan = plan
        self._models: dict[str, LlamaModel] = {}
        self._hf_models: dict[str, object] = {}
        self._matmul_ms: dict[tuple[str, int], float] = {}

    def model(self, dtype: str) -> LlamaModel:
        if dtype not in self._models:
            self._models[dtype] = load_model("bundled", DTYPES[dtype])
        return self._models[dtype]

    def hf_model(self, dtype: str):
        if dtype not in self._hf_models:
            self._hf_models[dtype] = load_hf(DTYPES[dtype])
        return self._hf_models[dtype]

    def drop_dtype(self, dtype: str) -> None:
        self._models.pop(dtype, None)
        self._hf_models.pop(dtype, None)
        gc.collect()

    def contender(self, key: Key) -> Contender:
        dtype, system, sessions, tokens = key
        plan, model = self.plan, self.model(dtype)
        kv_bytes_per_token = model.config.kv_bytes_per_token(model.dtype)
        if system == HF_SYSTEM:
            return Contender(key, sessions * (tokens + plan.decode_steps) * kv_bytes_per_token,
                             lambda: HfRun(self.hf_model(dtype), kv_bytes_per_token, sessions,
                                           tokens, plan))
        policy = plan.policies[system]
        pool_tokens = OursRun.pool_tokens(policy, sessions, tokens, plan)
        return Contender(key, pool_tokens * kv_bytes_per_token,
                         lambda: OursRun(model, policy, sessions, tokens, plan))

    def side_by_side(self, keys: list[Key], detail: bool = False) -> dict[Key, dict]:
        """Measure configurations together (see the package docstring); skip what cannot fit."""
        rows, fitting = {}, []
        for c in map(self.contender, keys):
            if c.kv_bytes > self.plan.kv_budget_bytes:
                rows[c.key] = {"status": "skipped: memory", "kv_bytes": c.kv_bytes}
                progress(f"{label(c.key)}: skipped: memory")
            else:
                fitting.append(c)
        for pack in packs(fitting, self.plan.side_by_side_budget_bytes):
            rows.update(self._measure_pack(pack, detail))
        return {key: {**rows[key], **dict(zip(KEY_FIELDS, key, strict=True))} for key in keys}

    def _measure_pack(self, pack: list[Contender], detail: bool) -> dict[Key, dict]:
        runs = {c.key: c.start() for c in pack}
        try:
            timed = time_interleaved({k: r.step for k, r in runs.items()},
                                     self.plan.warmup_steps, self.plan.repeats)
            rows = {}
            for key, run in runs.items():
                row = {"status": "ok", **timed[key], **run.facts(),
                       "side_by_side_with": [label(k) for k in runs if k != key]}
                if detail:
                    row.update(run.detail())
                dtype, _, sessions, _ = key
                add_flops(row, self.model(dtype), sessions, self._matmul_reference(dtype,
                                                                                   sessions))
                rows[key] = row
                progress(f"{label(key)}: median {row['step_ms_median']:.1f} ms, min "
                         f"{row['step_ms_min']:.1f} ms, load {row['load_avg_1m']:.1f}")
            return rows
        finally:
            for run in runs.values():
                run.close()
            del runs
            gc.collect()  # this pack's KV is gone before the next one allocates

    def _matmul_reference(self, dtype: str, sessions: int) -> float:
        key = (dtype, sessions)
        if key not in self._matmul_ms:
            self._matmul_ms[key] = matmul_reference_ms(self.model(dtype), sessions,
                                                       self.plan.repeats)
        return self._matmul_ms[key]


def compare_dtypes(bench: Bench) -> dict:
    """Focus configurations in both dtypes side by side; our lower geometric mean wins."""
    plan, rows = bench.plan, {}
    for tokens in plan.focus_tokens:
        for system in plan.systems:
            rows.update(bench.side_by_side(
                [(dtype, system, plan.focus_sessions, tokens) for dtype in DTYPES]))
    geomean_ms = {}
    for dtype in DTYPES:
        ours_ms = [r["step_ms_median"] for (d, s, _, _), r in rows.items()
                   if d == dtype and s != HF_SYSTEM and r["status"] == "ok"]
        if ours_ms:
            geomean_ms[dtype] = math.exp(statistics.fmean(map(math.log, ours_ms)))
    return {"chosen": min(geomean_ms, key=geomean_ms.get), "ours_geomean_step_ms": geomean_ms,
            "rule": "lower geometric mean of our median step time over the focus configurations",
            "rows": list(rows.values())}


def measure_grid(bench: Bench, dtype: str) -> dict[Key, dict]:
    """Per (N, L): both policies and transformers side by side (the ratio groups); only
    our policies, unprofiled, for a calibration-only run."""
    plan, rows = bench.plan, {}
    systems = list(plan.policies) if plan.calibration_only else plan.systems
    for sessions in plan.sessions:
        for tokens in plan.session_tokens:
            focus = (sessions == plan.focus_sessions and tokens in plan.focus_tokens
                     and not plan.calibration_only)
            rows.update(bench.side_by_side(
                [(dtype, system, sessions, tokens) for system in systems], detail=focus))
    return rows


def measure_flatness(bench: Bench, dtype: str) -> dict[Key, dict]:
    """Per N: the bounded policy at every L side by side (is its step flat in L?)."""
    plan, rows = bench.plan, {}
    for sessions in plan.sessions:
        rows.update(bench.side_by_side(
            [(dtype, plan.bounded_policy, sessions, t) for t in plan.session_tokens]))
    return rows
