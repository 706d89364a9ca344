"""Engine step benchmark: one batched decode step, ours (unbounded, sinks+window) vs transformers.

What one measurement is: N sessions, each already L tokens long, each feed one token and
sample one (greedy) in a single batched step. We report step latency (min / median over
`repeats` timed steps after warm-up), tokens/s (N / median step) and resident KV per session.
The same step through Hugging Face transformers, as a user writes it (batched `forward` on a
`DynamicCache`, argmax fed back), is timed in the same run and reported as a ratio.

Side by side: these machines are shared, so numbers that are compared with each other are
measured together. The configurations of a comparison (ours vs transformers at one N and L;
the bounded policy at every L; fp32 vs bf16) are set up at once and their steps interleaved
round-robin, so a burst of load elsewhere hits all of them alike. A group whose KV would
exceed the memory budget together is split into parts that fit (recorded per row).

Session history is synthetic: `Engine.fast_forward` lengthens sessions without running the
model (blocks allocated and slid exactly as for real tokens) and the pool holds random normal
K/V; the transformers cache is filled with random K/V of the same shape. Prefilling 64 x 8k
tokens would take hours on a small CPU, and K/V values do not change the step's cost.

Also measured: the share of step time outside model math (profiler, and a phase split of the
engine step) and achieved FLOP/s against a plain `torch.matmul` over the same linear shapes.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

# OpenMP (libgomp) reads its wait policy once, when torch loads it. Its default (spin, then
# sleep) turns a 100 ms step into > 1 s whenever another process holds one of this machine's 2
# cores: each of the step's ~1000 parallel regions spins waiting for a descheduled thread.
# Passive waiting is robust to that but slower on an idle machine; the bench measures both
# (`_wait_policy_probe`). Only effective if torch is not imported yet (the CLI); an explicit
# OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins.
SPIN_ENV = {"GOMP_SPINCOUNT": "300000"}  # libgomp's documented default spin count
OMP_WAIT_POLICY_SET_BY_BENCH = "torch" not in sys.modules and not (
    {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys())
if OMP_WAIT_POLICY_SET_BY_BENCH:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import torch  # noqa: E402

from metronome.engine.batch_builder import build_batch  # noqa: E402
from metronome.engine.engine import Engine, EngineConfig  # noqa: E402
from metronome.engine.session import SessionSpec  # noqa: E402
from metronome.kv.residency import ResidencyPolicy  # noqa: E402
from metronome.model.llama import LlamaModel  # noqa: E402
from metronome.model.weights import DTYPES, bundled_model_dir, load_model  # noqa: E402

COMMAND = "metronome bench engine"
MIB = 1 << 20
GIB = 1 << 30
BLOCK_SIZE_TOKENS = 16
HF_SYSTEM = "transformers"
OVERHEAD_GOAL_SHARE = 0.10
FLAT_GOAL_SHARE = 0.10
RATIO_GOAL = 0.7
TOP_OPS = 6
# aten ops grouped for the "where does the step go" split (self CPU time, profiler)
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
              "aten::linear", "aten::_scaled_dot_product_flash_attention_for_cpu"}
COPY_OPS = {"aten::copy_", "aten::index_select", "aten::index_copy_", "aten::cat",
            "aten::clone", "aten::contiguous", "aten::_to_copy"}

Key = tuple[str, str, int, int]  # (dtype, system, sessions, session_tokens)


@dataclass(frozen=True)
class Plan:
    """What one run measures: the full grid, or the CI smoke size (same code path)."""

    sessions: tuple[int, ...]
    session_tokens: tuple[int, ...]
    sink_tokens: int
    window_tokens: int
    repeats: int
    warmup_steps: int
    focus_sessions: int  # N of the dtype comparison, overhead split and profile
    focus_tokens: tuple[int, ...]  # L of those
    kv_budget_bytes: int  # cap on one configuration's KV (our pool or a transformers cache)
    side_by_side_budget_bytes: int  # cap on the KV of configurations measured together
    probe_busy_core: bool  # wait-policy probe also with one core busy (slow under spinning)

    @property
    def policies(self) -> dict[str, ResidencyPolicy]:
        bounded = ResidencyPolicy.sinks_window(self.sink_tokens, self.window_tokens)
        return {"unbounded": ResidencyPolicy.unbounded(), _policy_name(bounded): bounded}

    @property
    def bounded_policy(self) -> str:
        return next(name for name in self.policies if name != "unbounded")

    @property
    def systems(self) -> list[str]:
        return [*self.policies, HF_SYSTEM]

    @property
    def decode_steps(self) -> int:
        """Steps a session must be able to take: warm-up, timed, phase split, profiled."""
        return self.warmup_steps + 3 * self.repeats


def make_plan(smoke: bool, repeats: int) -> Plan:
    if smoke:  # CI size: seconds, same code path
        return Plan(sessions=(1, 4), session_tokens=(64, 256), sink_tokens=4, window_tokens=32,
                    repeats=2, warmup_steps=1, focus_sessions=4, focus_tokens=(64, 256),
                    kv_budget_bytes=GIB, side_by_side_budget_bytes=GIB, probe_busy_core=False)
    # 24 GiB machine: no single KV above 6 GiB, no group above 8 GiB (other work shares it)
    return Plan(sessions=(1, 8, 32, 64), session_tokens=(1024, 4096, 8192), sink_tokens=4,
                window_tokens=512, repeats=repeats, warmup_steps=2, focus_sessions=32,
                focus_tokens=(1024, 4096), kv_budget_bytes=6 * GIB,
                side_by_side_budget_bytes=8 * GIB, probe_busy_core=True)


def _policy_name(policy: ResidencyPolicy) -> str:
    return str(policy).removesuffix("@absolute")


def _label(key: Key) -> str:
    dtype, system, sessions, tokens = key
    return f"{dtype} {system} N={sessions} L={tokens}"


def _progress(message: str) -> None:
    print(f"[bench engine] {message}", file=sys.stderr, flush=True)


# ---- timing primitives ---------------------------------------------------------------------
def _timed_call(fn: Callable[[], object]) -> tuple[float, float, float, int]:
    """(wall ms, user CPU s, system CPU s, minor page faults) of one call."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    fn()
    wall_ms = (time.perf_counter() - start) * 1e3
    after = resource.getrusage(resource.RUSAGE_SELF)
    return (wall_ms, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
            after.ru_minflt - before.ru_minflt)


def _time_interleaved(steps: dict[Key, Callable[[], object]], warmup: int,
                      repeats: int) -> dict[Key, dict]:
    """Warm up, then time `repeats` steps of each, round-robin (start rotates every round)."""
    keys = list(steps)
    for _ in range(warmup):
        for key in keys:
            steps[key]()
    calls: dict[Key, list[tuple]] = {key: [] for key in keys}
    for i in range(repeats):
        for key in keys[i % len(keys):] + keys[: i % len(keys)]:
            calls[key].append(_timed_call(steps[key]))
    return {key: _timing_stats(calls[key]) for key in keys}


def _timing_stats(calls: list[tuple]) -> dict:
    step_ms = [c[0] for c in calls]
    user_s, sys_s = sum(c[1] for c in calls), sum(c[2] for c in calls)
    return {
        "step_ms": step_ms,
        "step_ms_min": min(step_ms),
        "step_ms_median": statistics.median(step_ms),
        "cpu_sys_share": sys_s / max(user_s + sys_s, 1e-9),
        "minor_faults_per_step": sum(c[3] for c in calls) / len(calls),
        "load_avg_1m": os.getloadavg()[0],
    }


def _profile_steps(step: Callable[[], object], num_steps: int) -> dict:
    """Steps under torch.profiler: aten self CPU time by kind vs. wall time, per step.

    `outside_aten_share` = 1 - (sum of aten self time) / wall: Python, dispatch and glue.
    Profiler bookkeeping adds a few us per op, so this share is an upper bound.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            step()
        wall_ms = (time.perf_counter() - start) * 1e3 / num_steps
    by_kind_ms = {"matmul": 0.0, "copy_gather": 0.0, "other_aten": 0.0}
    op_ms, aten_calls = {}, 0
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        kind = "matmul" if event.key in MATMUL_OPS else (
            "copy_gather" if event.key in COPY_OPS else "other_aten")
        by_kind_ms[kind] += event.self_cpu_time_total / 1e3 / num_steps
        op_ms[event.key] = event.self_cpu_time_total / 1e3 / num_steps
        aten_calls += event.count
    aten_ms = sum(by_kind_ms.values())
    return {
        "wall_ms": wall_ms,
        "aten_ms": by_kind_ms,
        "aten_calls_per_step": aten_calls / num_steps,  # nested calls included
        "outside_aten_share": max(0.0, 1 - aten_ms / wall_ms),
        "share_of_wall": {k: v / wall_ms for k, v in by_kind_ms.items()},
        "top_ops_ms": sorted(op_ms.items(), key=lambda kv: -kv[1])[:TOP_OPS],
    }


def _fill_random(store: torch.Tensor, seed: int) -> None:
    """Random normal K/V everywhere (a tiled random chunk: fast, and realistic for timing)."""
    chunk = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed)).to(store.dtype)
    flat = store.view(-1)
    for start in range(0, flat.numel(), chunk.numel()):
        end = min(start + chunk.numel(), flat.numel())
        flat[start:end].copy_(chunk[: end - start])


# ---- our engine ----------------------------------------------------------------------------
class _OursRun:
    """Our engine with N sessions of L tokens (synthetic history), each decoding every step."""

    def __init__(self, model: LlamaModel, policy: ResidencyPolicy, sessions: int, tokens: int,
                 plan: Plan) -> None:
        self.plan, self.sessions = plan, sessions
        pool_tokens = self.pool_tokens(policy, sessions, tokens, plan)
        self.engine = Engine(model, EngineConfig(block_size=BLOCK_SIZE_TOKENS,
                                                 pool_tokens=pool_tokens,
                                                 max_step_tokens=max(4096, sessions)))
        _fill_random(self.engine.cache.k, seed=1)
        _fill_random(self.engine.cache.v, seed=2)
        spec = SessionSpec(policy=policy, stop_token_ids=())  # no EOS: every step decodes
        self.session_ids = []
        for i in range(sessions):
            sid = self.engine.open_session(spec)
            assert self.engine.fast_forward(sid, tokens), "pool sized too small for the history"
            self.engine.submit(sid, [100 + i], max_new_tokens=plan.decode_steps)
            self.session_ids.append(sid)

    @staticmethod
    def pool_tokens(policy: ResidencyPolicy, sessions: int, tokens: int, plan: Plan) -> int:
        """Pool sized for this configuration: full history, or the policy's bound, plus slack."""
        block = BLOCK_SIZE_TOKENS
        if not policy.bounded:
            return sessions * (tokens + plan.decode_steps + 2 * block)
        blocks = -(-policy.sink_tokens // block) + -(-policy.window_tokens // block) + 3
        return sessions * blocks * block

    def step(self) -> None:
        result = self.engine.step()
        assert result.num_input_tokens == self.sessions, "every session decodes every step"

    def facts(self) -> dict:
        """Resident KV after the timed steps, and the keys the middle timed step attended."""
        sid, engine = self.session_ids[0], self.engine
        resident_tokens = engine.resident_tokens(sid)
        kv_bytes_per_token = engine.model.config.kv_bytes_per_token(engine.model.dtype)
        return {
            "kv_pool_bytes": engine.cache.nbytes,
            "attended_tokens": resident_tokens - (self.plan.repeats - self.plan.repeats // 2) + 1,
            "resident_tokens_per_session": resident_tokens,
            "resident_kv_bytes_per_session": engine.session_blocks(sid) * BLOCK_SIZE_TOKENS
            * kv_bytes_per_token,
        }

    def detail(self) -> dict:
        return {"phases_ms": _phase_split(self.engine, self.plan.repeats),
                "profile": _profile_steps(self.step, self.plan.repeats)}

    def close(self) -> None:
        for sid in self.session_ids:
            self.engine.close(sid)
        self.engine = None


def _phase_split(engine: Engine, repeats: int) -> dict:
    """Median ms of each phase of `Engine.step` (plan, build batch, forward, finish).

    Mirrors `Engine.step` from its parts so each can be timed; `sum_ms` next to the step's
    own median shows the mirror is faithful.
    """
    phases: dict[str, list[float]] = {"plan": [], "build_batch": [], "forward": [], "finish": []}
    model, block = engine.model, engine.config.block_size
    for _ in range(repeats):
        t0 = time.perf_counter()
        work, _ = engine._plan()
        t1 = time.perf_counter()
        batch = build_batch(work, model.embed, model.dtype, block)
        t2 = time.perf_counter()
        logits = model.forward(batch, engine.cache)
        t3 = time.perf_counter()
        engine._finish(work, logits)
        t4 = time.perf_counter()
        for name, ms in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[name].append(ms * 1e3)
    medians = {name: statistics.median(ms) for name, ms in phases.items()}
    medians["sum_ms"] = sum(medians.values())
    medians["bookkeeping_ms"] = medians["plan"] + medians["build_batch"] + medians["finish"]
    return medians


# ---- transformers baseline -----------------------------------------------------------------
def _load_hf(dtype: torch.dtype):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=dtype).eval()


class _HfRun:
    """transformers as a user writes it: one batched forward on a DynamicCache, argmax fed back.

    All sessions have the same length, so no attention mask; the cache grows by torch.cat.
    """

    def __init__(self, hf_model, kv_bytes_per_token: int, sessions: int, tokens: int,
                 plan: Plan) -> None:
        self.model, self.plan = hf_model, plan
        self.kv_bytes_per_token = kv_bytes_per_token
        self.cache = self._filled_cache(hf_model, sessions, tokens)
        self.ids = torch.arange(100, 100 + sessions).view(sessions, 1)
        self.position = tokens

    @staticmethod
    def _filled_cache(hf_model, sessions: int, tokens: int):
        """A DynamicCache already `tokens` long for a batch of `sessions` (random K/V)."""
        from transformers import DynamicCache

        cfg = hf_model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        gen = torch.Generator().manual_seed(3)
        shape = (sessions, cfg.num_key_value_heads, tokens, head_dim)  # (B, kvh, L, hd)
        k = torch.randn(shape, generator=gen).to(hf_model.dtype)
        v = torch.randn(shape, generator=gen).to(hf_model.dtype)
        cache = DynamicCache(config=cfg)
        for layer_idx in range(cfg.num_hidden_layers):
            cache.update(k, v, layer_idx)  # each layer keeps its own copy (torch.cat)
        return cache

    def step(self) -> None:
        with torch.inference_mode():
            positions = torch.full((self.ids.shape[0], 1), self.position)
            out = self.model(input_ids=self.ids, cache=self.cache, position_ids=positions,
                             use_cache=True)
            self.ids = out.logits[:, -1].argmax(-1, keepdim=True)
            self.position += 1

    def facts(self) -> dict:
        """Cache length after the timed steps, and the keys the middle timed step attended."""
        resident_tokens = self.cache.get_seq_length()
        return {
            "attended_tokens": resident_tokens - (self.plan.repeats - self.plan.repeats // 2) + 1,
            "resident_tokens_per_session": resident_tokens,
            "resident_kv_bytes_per_session": resident_tokens * self.kv_bytes_per_token,
        }

    def detail(self) -> dict:
        return {"profile": _profile_steps(self.step, self.plan.repeats)}

    def close(self) -> None:
        self.cache = None


# ---- FLOPs and the plain-matmul reference --------------------------------------------------
def _linear_weights(model: LlamaModel) -> list[torch.Tensor]:
    """Every weight a decode step multiplies by, in order (lm_head last)."""
    weights = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return weights + [model.lm_head]


def _step_flops(model: LlamaModel, sessions: int, attended_tokens: int) -> dict:
    """FLOPs of one decode step: linears (every row needs logits) and attention scores/values."""
    cfg = model.config
    linear = 2 * sessions * sum(w.numel() for w in _linear_weights(model))
    attention = 2 * 2 * cfg.num_heads * cfg.head_dim * attended_tokens * sessions * cfg.num_layers
    return {"linear": linear, "attention": attention, "total": linear + attention}


def _matmul_reference_ms(model: LlamaModel, sessions: int, repeats: int) -> float:
    """Median ms of plain `torch.matmul(x, W.T)` over the step's linear shapes, same weights."""
    gen = torch.Generator().manual_seed(4)
    inputs = {n: torch.randn(sessions, n, generator=gen).to(model.dtype)
              for n in {w.shape[1] for w in _linear_weights(model)}}

    def all_linears() -> None:
        for w in _linear_weights(model):
            torch.matmul(inputs[w.shape[1]], w.t())

    with torch.inference_mode():
        all_linears()  # warm-up
        return statistics.median(_timed_call(all_linears)[0] for _ in range(max(repeats, 3)))


def _add_flops(row: dict, model: LlamaModel, sessions: int, matmul_ref_ms: float) -> None:
    flops = _step_flops(model, sessions, row["attended_tokens"])
    row["flops"] = flops
    row["tokens_per_s"] = sessions / (row["step_ms_median"] / 1e3)
    row["achieved_flops_per_s"] = flops["total"] / (row["step_ms_median"] / 1e3)
    row["matmul_ref_ms"] = matmul_ref_ms
    row["matmul_ref_flops_per_s"] = flops["linear"] / (matmul_ref_ms / 1e3)
    row["achieved_over_matmul_ref"] = row["achieved_flops_per_s"] / row["matmul_ref_flops_per_s"]


# ---- orchestration -------------------------------------------------------------------------
@dataclass
class _Contender:
    key: Key
    kv_bytes: int
    start: Callable[[], _OursRun | _HfRun]


def _packs(contenders: list[_Contender], budget_bytes: int) -> list[list[_Contender]]:
    """Split a side-by-side group, in order, into parts whose KV fits the budget together."""
    packs: list[list[_Contender]] = []
    for c in contenders:
        if packs and sum(p.kv_bytes for p in packs[-1]) + c.kv_bytes <= budget_bytes:
            packs[-1].append(c)
        else:
            packs.append([c])
    return packs


class _Bench:
    """Models per dtype; measures groups of configurations side by side."""

    def __init__(self, plan: Plan) -> None:
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
            self._hf_models[dtype] = _load_hf(DTYPES[dtype])
        return self._hf_models[dtype]

    def drop_dtype(self, dtype: str) -> None:
        self._models.pop(dtype, None)
        self._hf_models.pop(dtype, None)
        gc.collect()

    def contender(self, key: Key) -> _Contender:
        dtype, system, sessions, tokens = key
        plan, model = self.plan, self.model(dtype)
        kv_bytes_per_token = model.config.kv_bytes_per_token(model.dtype)
        if system == HF_SYSTEM:
            return _Contender(key, sessions * (tokens + plan.decode_steps) * kv_bytes_per_token,
                              lambda: _HfRun(self.hf_model(dtype), kv_bytes_per_token, sessions,
                                             tokens, plan))
        policy = plan.policies[system]
        pool_tokens = _OursRun.pool_tokens(policy, sessions, tokens, plan)
        return _Contender(key, pool_tokens * kv_bytes_per_token,
                          lambda: _OursRun(model, policy, sessions, tokens, plan))

    def side_by_side(self, keys: list[Key], detail: bool = False) -> dict[Key, dict]:
        """Measure configurations together (see the module docstring); skip what cannot fit."""
        rows, fitting = {}, []
        for c in map(self.contender, keys):
            if c.kv_bytes > self.plan.kv_budget_bytes:
                rows[c.key] = {"status": "skipped: memory", "kv_bytes": c.kv_bytes}
                _progress(f"{_label(c.key)}: skipped: memory")
            else:
                fitting.append(c)
        for pack in _packs(fitting, self.plan.side_by_side_budget_bytes):
            rows.update(self._measure_pack(pack, detail))
        return {key: {**rows[key], **dict(zip(("dtype", "system", "sessions", "session_tokens"),
                                               key, strict=True))} for key in keys}

    def _measure_pack(self, pack: list[_Contender], detail: bool) -> dict[Key, dict]:
        runs = {c.key: c.start() for c in pack}
        try:
            timed = _time_interleaved({k: r.step for k, r in runs.items()},
                                      self.plan.warmup_steps, self.plan.repeats)
            rows = {}
            for key, run in runs.items():
                row = {"status": "ok", **timed[key], **run.facts(),
                       "side_by_side_with": [_label(k) for k in runs if k != key]}
                if detail:
                    row.update(run.detail())
                dtype, _, sessions, _ = key
                _add_flops(row, self.model(dtype), sessions, self._matmul_reference(dtype,
                                                                                     sessions))
                rows[key] = row
                _progress(f"{_label(key)}: median {row['step_ms_median']:.1f} ms, min "
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
            self._matmul_ms[key] = _matmul_reference_ms(self.model(dtype), sessions,
                                                        self.plan.repeats)
        return self._matmul_ms[key]


def _compare_dtypes(bench: _Bench) -> dict:
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


def _measure_grid(bench: _Bench, dtype: str) -> dict[Key, dict]:
    """Per (N, L): both policies and transformers side by side (the ratio groups)."""
    plan, rows = bench.plan, {}
    for sessions in plan.sessions:
        for tokens in plan.session_tokens:
            focus = sessions == plan.focus_sessions and tokens in plan.focus_tokens
            rows.update(bench.side_by_side(
                [(dtype, system, sessions, tokens) for system in plan.systems], detail=focus))
    return rows


def _measure_flatness(bench: _Bench, dtype: str) -> dict[Key, dict]:
    """Per N: the bounded policy at every L side by side (is its step flat in L?)."""
    plan, rows = bench.plan, {}
    for sessions in plan.sessions:
        rows.update(bench.side_by_side(
            [(dtype, plan.bounded_policy, sessions, t) for t in plan.session_tokens]))
    return rows


# ---- OpenMP wait policy ------------------------------------------------------------------
WAIT_POLICIES = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin": SPIN_ENV}
PROBE_FIELDS = ("dtype", "system", "sessions", "session_tokens", "step_ms_median", "step_ms_min",
                "load_avg_1m")


def _probe_keys(plan: Plan, dtype: str) -> list[Key]:
    tokens, sessions = plan.focus_tokens[0], plan.focus_sessions
    return [(dtype, plan.bounded_policy, 1, tokens), (dtype, "unbounded", sessions, tokens),
            (dtype, plan.bounded_policy, sessions, tokens), (dtype, HF_SYSTEM, sessions, tokens)]


def probe_main(smoke: bool, repeats: int, dtype: str) -> None:
    """Child-process entry of `_wait_policy_probe`: the probe rows as JSON on stdout."""
    plan = make_plan(smoke, repeats)
    rows = _Bench(plan).side_by_side(_probe_keys(plan, dtype))
    print(json.dumps([{f: row[f] for f in PROBE_FIELDS} for row in rows.values()]))


@contextmanager
def _one_core_busy():
    """Another process spinning on one core: the shared-machine condition, made on purpose."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def _probe_child(smoke: bool, repeats: int, dtype: str, env: dict) -> list[dict]:
    child_env = {k: v for k, v in os.environ.items()
                 if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    code = ("from metronome.bench.engine_bench import probe_main; "
            f"probe_main({smoke!r}, {repeats!r}, {dtype!r})")
    done = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout)


def _wait_policy_probe(plan: Plan, smoke: bool, dtype: str) -> list[dict]:
    """A few configurations under each OpenMP wait policy, as found and with one core busy.

    Each policy runs in its own child process (the policy is fixed when torch loads);
    the policies alternate within a condition.
    """
    conditions: dict[str, Callable[[], AbstractContextManager]] = {"as found": nullcontext}
    if plan.probe_busy_core:
        conditions["one core busy"] = _one_core_busy
    rows = []
    for condition, make_context in conditions.items():
        with make_context():
            for policy, env in WAIT_POLICIES.items():
                for row in _probe_child(smoke, plan.repeats, dtype, env):
                    rows.append({**row, "condition": condition, "wait_policy": policy})
                    key = tuple(row[f] for f in PROBE_FIELDS[:4])
                    _progress(f"wait policy {policy}, {condition}: {_label(key)}: median "
                              f"{row['step_ms_median']:.1f} ms")
    return rows


# ---- analysis ------------------------------------------------------------------------------
def _ok(rows: dict[Key, dict], key: Key) -> dict | None:
    row = rows.get(key)
    return row if row is not None and row["status"] == "ok" else None


def _ratios(grid: dict[Key, dict], plan: Plan, dtype: str) -> list[dict]:
    """Our step time over transformers' for the same (N, L), per policy (median and min)."""
    out = []
    for sessions in plan.sessions:
        for tokens in plan.session_tokens:
            hf = _ok(grid, (dtype, HF_SYSTEM, sessions, tokens))
            for policy in plan.policies:
                ours = _ok(grid, (dtype, policy, sessions, tokens))
                if hf and ours:
                    out.append({"sessions": sessions, "session_tokens": tokens, "policy": policy,
                                "ratio_median": ours["step_ms_median"] / hf["step_ms_median"],
                                "ratio_min": ours["step_ms_min"] / hf["step_ms_min"],
                                "side_by_side": bool(ours["side_by_side_with"])
                                and _label((dtype, HF_SYSTEM, sessions, tokens))
                                in ours["side_by_side_with"]})
    return out


def _flatness(rows: dict[Key, dict], plan: Plan, dtype: str, systems: list[str],
              measured: str) -> list[dict]:
    """Per N and system: step time at each L, absolute and relative to the shortest L."""
    out = []
    for sessions in plan.sessions:
        for system in systems:
            found = [r for t in plan.session_tokens
                     if (r := _ok(rows, (dtype, system, sessions, t)))]
            if len(found) < 2:
                continue
            first_med, first_min = found[0]["step_ms_median"], found[0]["step_ms_min"]
            out.append({
                "sessions": sessions, "system": system, "measured": measured,
                "session_tokens": [r["session_tokens"] for r in found],
                "step_ms_median": [r["step_ms_median"] for r in found],
                "relative_median": [r["step_ms_median"] / first_med for r in found],
                "relative_min": [r["step_ms_min"] / first_min for r in found],
            })
    return out


def _overhead(grid: dict[Key, dict], plan: Plan, dtype: str) -> list[dict]:
    """Profile split (and, for ours, the phase split) at the focus configurations."""
    out = []
    for tokens in plan.focus_tokens:
        for system in plan.systems:
            row = _ok(grid, (dtype, system, plan.focus_sessions, tokens))
            if row and "profile" in row:
                entry = {"sessions": plan.focus_sessions, "session_tokens": tokens,
                         "system": system, "step_ms_median": row["step_ms_median"],
                         "profile": row["profile"]}
                if "phases_ms" in row:
                    phases = row["phases_ms"]
                    entry["phases_ms"] = phases
                    entry["bookkeeping_share"] = phases["bookkeeping_ms"] / phases["sum_ms"]
                out.append(entry)
    return out


def _wait_policy_table(rows: list[dict]) -> list[dict]:
    """Per condition and configuration: passive vs spin median step time."""
    by_key = {(r["condition"], r["system"], r["sessions"], r["session_tokens"], r["wait_policy"]):
              r for r in rows}
    out = []
    for (condition, system, sessions, tokens, policy), row in by_key.items():
        spin = by_key.get((condition, system, sessions, tokens, "spin"))
        if policy == "passive" and spin:
            out.append({"condition": condition, "system": system, "sessions": sessions,
                        "session_tokens": tokens, "passive_ms": row["step_ms_median"],
                        "spin_ms": spin["step_ms_median"],
                        "spin_over_passive": spin["step_ms_median"] / row["step_ms_median"],
                        "load_avg_1m": row["load_avg_1m"]})
    return out


def _goal_flat(flatness: list[dict], bounded: str) -> dict:
    bounded_dev = [max(abs(x - 1) for x in f["relative_median"])
                   for f in flatness if f["system"] == bounded]
    growth = [f["relative_median"][-1] for f in flatness if f["system"] == "unbounded"]
    # unbounded must grow where attention matters most: the largest N measured at 2+ lengths
    reached = (bool(bounded_dev) and max(bounded_dev) <= FLAT_GOAL_SHARE and bool(growth)
               and growth[-1] > 1 + FLAT_GOAL_SHARE)
    nan = math.nan
    detail = (f"{bounded}: largest deviation from the shortest length "
              f"{_pct(max(bounded_dev, default=nan))} over N (median step, all lengths side by "
              f"side); unbounded grows {_x(min(growth, default=nan))} to "
              f"{_x(max(growth, default=nan))} from shortest to longest length over N "
              f"({_x(growth[-1] if growth else nan)} at the largest N)")
    return {"goal": "bounded step time flat (±10 %) from shortest to longest session while "
            "unbounded grows", "reached": reached, "detail": detail}


def _goal_ratio(ratios: list[dict], policy: str) -> dict:
    values = [r["ratio_median"] for r in ratios if r["policy"] == policy]
    met = sum(v <= RATIO_GOAL for v in values)
    return {"goal": f"ours ({policy}) ≤ {RATIO_GOAL}× transformers on the same workload",
            "reached": bool(values) and met == len(values),
            "detail": f"{met} of {len(values)} configurations; ratio "
                      f"{_x(min(values, default=math.nan))} to {_x(max(values, default=math.nan))}"}


def _goal_overhead(overhead: list[dict]) -> dict:
    ours = [o for o in overhead if o["system"] != HF_SYSTEM]
    shares = [o["profile"]["outside_aten_share"] for o in ours]
    bookkeeping = [o["bookkeeping_share"] for o in ours]
    nan = math.nan
    return {"goal": f"overhead outside model math ≤ {_pct(OVERHEAD_GOAL_SHARE)} at the focus N",
            "reached": bool(shares) and max(shares) <= OVERHEAD_GOAL_SHARE,
            "detail": f"time outside aten ops {_pct(min(shares, default=nan))} to "
                      f"{_pct(max(shares, default=nan))} of a profiled step; Python "
                      f"bookkeeping (plan + build_batch + finish) "
                      f"{_pct(min(bookkeeping, default=nan))} to "
                      f"{_pct(max(bookkeeping, default=nan))} of an unprofiled step"}


def _limits(grid: dict[Key, dict], dtype: str, overhead: list[dict]) -> list[str]:
    """Where the step time goes, in sentences built from the measured numbers."""
    lines = []
    for o in overhead:
        share = o["profile"]["share_of_wall"]
        row = grid[(dtype, o["system"], o["sessions"], o["session_tokens"])]
        top = ", ".join(f"{name.removeprefix('aten::')} {ms:.1f}"
                        for name, ms in o["profile"]["top_ops_ms"])
        lines.append(
            f"{o['system']}, N={o['sessions']}, L={o['session_tokens']}: copies/gathers "
            f"{_pct(share['copy_gather'])} of a profiled step, matmul {_pct(share['matmul'])}, "
            f"other aten {_pct(share['other_aten'])}, outside aten "
            f"{_pct(o['profile']['outside_aten_share'])} "
            f"({o['profile']['aten_calls_per_step']:.0f} aten calls per step; profiled steps "
            f"{_x(o['profile']['wall_ms'] / o['step_ms_median'])} the timed ones). "
            f"Top ops (self ms per step): {top}. Kernel (sys) "
            f"CPU {_pct(row['cpu_sys_share'])} of step CPU time, "
            f"{row['minor_faults_per_step']:.0f} minor page faults per step. A plain matmul "
            f"over the step's linear shapes takes {row['matmul_ref_ms']:.1f} ms "
            f"({_pct(row['matmul_ref_ms'] / row['step_ms_median'])} of the median step).")
    return lines


def _wait_policy_limits(table: list[dict]) -> list[str]:
    lines = []
    for condition in dict.fromkeys(w["condition"] for w in table):
        ratios = [w["spin_over_passive"] for w in table if w["condition"] == condition]
        lines.append(f"OpenMP wait policy, {condition}: spinning takes {_x(min(ratios))} to "
                     f"{_x(max(ratios))} the step time of passive waiting (see the table above).")
    return lines


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.1f} %"


def _x(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}×"


# ---- machine and report ------------------------------------------------------------------
def _omp_wait_policy() -> str:
    if OMP_WAIT_POLICY_SET_BY_BENCH:
        return "PASSIVE (set by the bench)"
    if "OMP_WAIT_POLICY" in os.environ:
        return f"{os.environ['OMP_WAIT_POLICY']} (from the environment)"
    return "default (torch was imported before the bench could set it)"


def _machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model_names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines()
                   if ln.startswith("model name")]
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines()
                  if ln.startswith("flags")), [])
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_kib = next((int(ln.split()[1]) for ln in meminfo.splitlines()
                    if ln.startswith("MemTotal")), 0)
    import transformers

    return {
        "cpu_model": model_names[0] if model_names else platform.processor(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": _omp_wait_policy(),
        "bf16_isa": [f for f in ("avx512_bf16", "amx_bf16") if f in flags],
        "memory_gib": mem_kib / (1 << 20),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1m_start": os.getloadavg()[0],
    }


def _table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _md_header(res: dict) -> str:
    m, plan = res["machine"], res["plan"]
    return f"""# Engine step benchmark

Generated by `{res['command']}`{' --smoke' if res['smoke'] else ''} on {res['finished_utc']} \
({res['elapsed_s']:.0f} s). Written by the command; do not edit by hand.

**Machine**: {m['cpu_model']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']:.0f} GiB \
RAM, bf16 ISA: {', '.join(m['bf16_isa']) or 'none'}; torch {m['torch']} ({m['torch_threads']} \
threads, OpenMP wait policy {m['omp_wait_policy']}), transformers {m['transformers']}, \
Python {m['python']}. Load average (1 min): \
{m['load_avg_1m_start']:.1f} at start, {res['load_avg_1m_end']:.1f} at end. The machine is \
shared: compare numbers measured side by side (ratios), not absolute times.

**Workload**: one batched decode step. N sessions, each L tokens long, each feed one token and \
sample one (greedy) in one step. {plan['warmup_steps']} warm-up steps, then {plan['repeats']} \
timed steps; min and median. tokens/s = N / median step. Sessions grow by one token per step. \
Session history is synthetic: `Engine.fast_forward` allocates and slides blocks exactly as real \
tokens would, and K/V hold random normal values (prefilling 64 × 8k tokens would take hours \
here; K/V values do not change the cost). transformers runs the same step as a user writes it: \
`model(input_ids, cache=DynamicCache, position_ids)` with random K/V of the same shape, argmax \
fed back, no attention mask (all sessions have the same length). Block size \
{BLOCK_SIZE_TOKENS} tokens.

**Side by side**: numbers that are compared are measured together: the configurations of a \
comparison are set up at once and their steps interleaved round-robin (ours vs transformers \
per N and L; the bounded policy at all L per N; fp32 vs bf16), so load from other processes \
hits them alike. KV held at once is capped at {plan['side_by_side_budget_bytes'] / GIB:.0f} \
GiB: a group that does not fit is split into parts measured one after another (column "with"). \
A configuration whose KV alone (our pool, or the transformers cache) exceeds \
{plan['kv_budget_bytes'] / GIB:.0f} GiB is skipped ("skipped: memory").

**dtype**: {res['dtype']['chosen']} for the main grid ({res['dtype']['rule']}).
"""


def _md_dtype(res: dict) -> str:
    rows = [[r["dtype"], r["system"], r["sessions"], r["session_tokens"],
             _fmt_ms(r, "step_ms_median"), _fmt_ms(r, "step_ms_min"), _fmt_tps(r), _with(r, 0)]
            for r in res["dtype"]["rows"]]
    geo = ", ".join(f"{d} {ms:.1f} ms" for d, ms in res["dtype"]["ours_geomean_step_ms"].items())
    return ("## fp32 vs bf16\n\n" + _table(
        ["dtype", "system", "N", "L", "median ms", "min ms", "tokens/s", "with"], rows)
        + f"\n\nGeometric mean of our median step: {geo}.\n")


def _fmt_ms(row: dict, key: str) -> str:
    return f"{row[key]:.1f}" if row["status"] == "ok" else row["status"]


def _fmt_tps(row: dict) -> str:
    return f"{row['tokens_per_s']:.1f}" if row["status"] == "ok" else "-"


def _with(row: dict, part: int = 1) -> str:
    """What a row was measured side by side with: other systems (part 1) or dtypes (part 0)."""
    others = [label.split()[part] for label in row.get("side_by_side_with", [])]
    return ", ".join(others) or "alone"


def _md_grid(res: dict) -> str:
    parts = [f"## Step latency ({res['dtype']['chosen']})\n"]
    for system in res["systems"]:
        rows = []
        for r in res["grid"]:
            if r["system"] != system:
                continue
            ok = r["status"] == "ok"
            rows.append([r["sessions"], r["session_tokens"], _fmt_ms(r, "step_ms_min"),
                         _fmt_ms(r, "step_ms_median"), _fmt_tps(r),
                         r["resident_tokens_per_session"] if ok else "-",
                         f"{r['resident_kv_bytes_per_session'] / MIB:.1f}" if ok else "-",
                         _pct(r["cpu_sys_share"]) if ok else "-",
                         f"{r['load_avg_1m']:.1f}" if ok else "-", _with(r) if ok else "-"])
        parts.append(f"### {system}\n\n" + _table(
            ["N", "L", "min ms", "median ms", "tokens/s", "resident tokens/session",
             "resident KV MiB/session", "sys CPU", "load", "with"], rows) + "\n")
    return "\n".join(parts)


def _md_ratios(res: dict) -> str:
    rows = [[r["sessions"], r["session_tokens"], r["policy"], _x(r["ratio_median"]),
             _x(r["ratio_min"]), "yes" if r["side_by_side"] else "no"] for r in res["ratios"]]
    return ("## Ours / transformers (step time, same N and L)\n\n"
            "`unbounded` attends to the same keys as transformers (apples to apples); the "
            "bounded policy is what a Metronome user gets instead of a plain transformers "
            "loop.\n\n" + _table(["N", "L", "ours policy", "ratio (median)", "ratio (min)",
                                   "side by side"], rows) + "\n")


def _md_flatness(res: dict) -> str:
    rows = [[f["sessions"], f["system"], ", ".join(map(str, f["session_tokens"])),
             ", ".join(f"{x:.1f}" for x in f["step_ms_median"]),
             ", ".join(f"{x:.2f}" for x in f["relative_median"]),
             ", ".join(f"{x:.2f}" for x in f["relative_min"]), f["measured"]]
            for f in res["flatness"]]
    return ("## Step time vs session length (relative to the shortest)\n\n" + _table(
        ["N", "system", "L", "median ms", "median / shortest", "min / shortest", "measured"],
        rows) + "\n")


def _md_overhead(res: dict) -> str:
    rows, phase_rows = [], []
    for o in res["overhead"]:
        p, share = o["profile"], o["profile"]["share_of_wall"]
        rows.append([o["system"], o["sessions"], o["session_tokens"], f"{o['step_ms_median']:.1f}",
                     f"{p['wall_ms']:.1f}", _x(p["wall_ms"] / o["step_ms_median"]),
                     f"{p['aten_calls_per_step']:.0f}", _pct(share["matmul"]),
                     _pct(share["copy_gather"]), _pct(share["other_aten"]),
                     _pct(p["outside_aten_share"])])
        if "phases_ms" in o:
            ph = o["phases_ms"]
            phase_rows.append([o["system"], o["sessions"], o["session_tokens"],
                               f"{ph['plan']:.2f}", f"{ph['build_batch']:.2f}",
                               f"{ph['forward']:.1f}", f"{ph['finish']:.2f}",
                               _pct(o["bookkeeping_share"])])
    return f"""## Where the step goes (N={res['plan']['focus_sessions']}, {res['dtype']['chosen']})

Profiled steps ({res['plan']['repeats']}, torch.profiler, after the timed ones): self CPU time
of aten ops by kind, as a share of the profiled steps' wall time. matmul = mm/addmm/bmm/linear/
SDPA; copies/gathers = copy_/clone/index_select/index_copy_/cat/_to_copy; outside aten = wall
time not inside any aten op (Python, dispatch, profiler bookkeeping: an upper bound). Where
profiled steps ran much slower than the timed ones ("profiled / timed"), their shares describe
those slower steps.

{_table(["system", "N", "L", "timed step ms (median)", "profiled step ms", "profiled / timed",
         "aten calls/step", "matmul", "copies/gathers", "other aten", "outside aten"], rows)}

Phase split of our step (unprofiled medians, ms): `Engine._plan`, `build_batch`, model forward,
`Engine._finish`; bookkeeping = plan + build_batch + finish as a share of their sum.

{_table(["policy", "N", "L", "plan", "build_batch", "forward", "finish", "bookkeeping"],
        phase_rows)}
"""


def _md_flops(res: dict) -> str:
    rows = []
    for r in res["grid"]:
        if r["status"] != "ok" or r["sessions"] != res["plan"]["focus_sessions"]:
            continue
        rows.append([r["system"], r["sessions"], r["session_tokens"],
                     f"{r['flops']['total'] / 1e9:.2f}",
                     f"{r['achieved_flops_per_s'] / 1e9:.1f}",
                     f"{r['matmul_ref_flops_per_s'] / 1e9:.1f}",
                     _x(r["achieved_over_matmul_ref"]),
                     _pct(r["matmul_ref_ms"] / r["step_ms_median"])])
    return f"""## Achieved FLOP/s (N={res['plan']['focus_sessions']})

Step FLOPs = linears (2 × rows × weight elements, all layers + lm_head) + attention
(2 × 2 × heads × head_dim × attended keys, per token and layer), over the median step. The
reference is a plain `torch.matmul(x, W.T)` over the same linear shapes and weights, timed in
this run; "matmul share" is that reference's time as a share of the step: the linear-math floor.
All N are in engine.json.

{_table(["system", "N", "L", "GFLOP/step", "achieved GFLOP/s", "plain matmul GFLOP/s",
         "achieved / matmul", "matmul share of step"], rows)}
"""


def _md_wait_policy(res: dict) -> str:
    rows = [[w["condition"], w["system"], w["sessions"], w["session_tokens"],
             f"{w['passive_ms']:.1f}", f"{w['spin_ms']:.1f}", _x(w["spin_over_passive"]),
             f"{w['load_avg_1m']:.1f}"] for w in res["wait_policy"]]
    return f"""## OpenMP wait policy

OpenMP fixes its wait policy when torch loads, so each policy runs in its own child process:
`passive` (OMP_WAIT_POLICY=PASSIVE: idle threads sleep) and `spin` (libgomp's default: spin
{SPIN_ENV['GOMP_SPINCOUNT']} iterations, then sleep). "as found" is the machine as it was during
the run; "one core busy" adds one process spinning on a core (what a shared machine, or a
server's own other threads, do). Median step ms. This run's other sections use:
{res['machine']['omp_wait_policy']}.

{_table(["condition", "system", "N", "L", "passive ms", "spin ms", "spin / passive", "load"],
        rows)}
"""


def _md_goals(res: dict) -> str:
    lines = ["## Goals\n"]
    for g in res["goals"]:
        verdict = "reached" if g["reached"] else "not reached"
        lines.append(f"- **{verdict}**: {g['goal']}. {g['detail']}.")
    lines.append("\n## What limits it (from the profile above)\n")
    lines += [f"- {line}" for line in res["limits"]]
    return "\n".join(lines) + "\n"


def _markdown(res: dict) -> str:
    sections = (_md_header, _md_dtype, _md_grid, _md_ratios, _md_flatness, _md_overhead,
                _md_flops, _md_wait_policy, _md_goals)
    return "\n".join(section(res) for section in sections)


# ---- entry point ---------------------------------------------------------------------------
def _summarize(plan: Plan, measured: dict, machine: dict, smoke: bool) -> dict:
    dtype_choice, grid, flat = measured["dtype"], measured["grid"], measured["flat"]
    chosen = dtype_choice["chosen"]
    flatness = (_flatness(flat, plan, chosen, [plan.bounded_policy], "all lengths side by side")
                + _flatness(grid, plan, chosen, ["unbounded", HF_SYSTEM],
                            "one length at a time, side by side with the other systems"))
    ratios, overhead = _ratios(grid, plan, chosen), _overhead(grid, plan, chosen)
    wait_policy = _wait_policy_table(measured["wait_policy"])
    return {
        "command": COMMAND, "smoke": smoke,
        "plan": {**asdict(plan), "policies": list(plan.policies)},
        "machine": machine, "systems": plan.systems, "dtype": dtype_choice,
        "grid": list(grid.values()), "flat": list(flat.values()),
        "ratios": ratios, "flatness": flatness, "overhead": overhead,
        "wait_policy": wait_policy,
        "goals": [_goal_flat(flatness, plan.bounded_policy), _goal_ratio(ratios, "unbounded"),
                  _goal_ratio(ratios, plan.bounded_policy), _goal_overhead(overhead)],
        "limits": _limits(grid, chosen, overhead) + _wait_policy_limits(wait_policy),
        "load_avg_1m_end": os.getloadavg()[0],
        "finished_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
    }


def run(out_md: str, out_json: str, smoke: bool, repeats: int) -> dict:
    """Measure, print the results as JSON, and write them to `out_json` and `out_md`."""
    started = time.perf_counter()
    plan = make_plan(smoke, repeats)
    machine = _machine()
    bench = _Bench(plan)
    dtype_choice = _compare_dtypes(bench)
    chosen = dtype_choice["chosen"]
    for dtype in DTYPES:
        if dtype != chosen:
            bench.drop_dtype(dtype)
    measured = {"dtype": dtype_choice, "grid": _measure_grid(bench, chosen),
                "flat": _measure_flatness(bench, chosen)}
    bench.drop_dtype(chosen)  # the probe's child processes load their own
    measured["wait_policy"] = _wait_policy_probe(plan, smoke, chosen)
    results = _summarize(plan, measured, machine, smoke)
    results["elapsed_s"] = time.perf_counter() - started
    text = json.dumps(results, indent=1)
    for path, content in ((out_json, text + "\n"), (out_md, _markdown(results))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
    print(text)
    return results
