"""Where one step goes: aten self time by kind under torch.profiler (any system), and the
phase split of our `Engine.step` (plan, build batch, forward, finish)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from metronome.engine.batch_builder import paged_first
from metronome.engine.engine import Engine
from metronome.model.llama import PAGED_ATTENTION_EVENT

TOP_OPS = 6
# aten ops grouped for the "where does the step go" split (self CPU time, profiler)
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
              "aten::linear", "mkldnn::_linear_pointwise"}
# fused attention: torch's SDPA, and our compiled kernel (a named span: it is not an aten op)
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu", PAGED_ATTENTION_EVENT}
COPY_OPS = {"aten::copy_", "aten::index_select", "aten::index_copy_", "aten::cat",
            "aten::clone", "aten::contiguous", "aten::_to_copy"}


def profile_steps(step: Callable[[], object], num_steps: int) -> dict:
    """Steps under torch.profiler: op self CPU time by kind vs. wall time, per step.

    Ops are aten's and oneDNN's, plus the span around our paged-attention kernel; kinds are
    matmul (the projections), attention (SDPA or the paged kernel), copy/gather, other.
    `outside_aten_share` = 1 - (sum of op self time) / wall: Python, dispatch and glue.
    Profiler bookkeeping adds a few us per op, so this share is an upper bound.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            step()
        wall_ms = (time.perf_counter() - start) * 1e3 / num_steps
    by_kind_ms = {"matmul": 0.0, "attention": 0.0, "copy_gather": 0.0, "other_aten": 0.0}
    op_ms, aten_calls = {}, 0
    for event in prof.key_averages():
        if not event.key.startswith(("aten::", "mkldnn::")) and event.key not in ATTENTION_OPS:
            continue
        kind = "matmul" if event.key in MATMUL_OPS else (
            "attention" if event.key in ATTENTION_OPS else (
                "copy_gather" if event.key in COPY_OPS else "other_aten"))
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


def phase_split(engine: Engine, repeats: int) -> dict:
    """Median ms of each phase of `Engine.step` (plan, build batch, forward, finish).

    Mirrors `Engine.step` from its parts so each can be timed; `sum_ms` next to the step's
    own median shows the mirror is faithful.
    """
    phases: dict[str, list[float]] = {"plan": [], "build_batch": [], "forward": [], "finish": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        work, _ = engine._plan()
        work = paged_first(work, engine.paged_max_chunk_tokens)
        t1 = time.perf_counter()
        batch = engine.build_batch(work)
        t2 = time.perf_counter()
        logits = engine.model.forward(batch, engine.cache, engine.kernel)
        t3 = time.perf_counter()
        engine._finish(work, logits)
        t4 = time.perf_counter()
        for name, ms in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[name].append(ms * 1e3)
    medians = {name: statistics.median(ms) for name, ms in phases.items()}
    medians["sum_ms"] = sum(medians.values())
    medians["bookkeeping_ms"] = medians["plan"] + medians["build_batch"] + medians["finish"]
    return medians
