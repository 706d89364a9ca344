"""Where one step goes: aten self time by kind under torch.profiler (any system), and the
phase split of our `Engine.step` (plan, build batch, forward, finish)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from metronome.engine.batch_builder import paged_first
from metronome.engine.engine import Engine
from metronome.model.linear import SMALL_LINEAR_EVENT
from metronome.model.llama import PAGED_ATTENTION_EVENT

TOP_OPS = 6
# Kinds of the "where does the step go" split (self CPU time under torch.profiler).
# attention: torch's SDPA (any of its kernels) and our compiled kernel (a named span: it is
# not an aten op), with every op run inside them, and batched matmuls (bmm/baddbmm, and an
# aten::matmul that dispatches to one): the dense path's explicit scores and values, eager
# attention in transformers. matmul: the 2-D GEMMs, i.e. the projections and lm_head (a
# model's linears are never batched, so nothing of attention lands here).
ATTENTION_OPS = {"aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math", PAGED_ATTENTION_EVENT}
BATCHED_MATMUL_OPS = {"aten::bmm", "aten::baddbmm"}
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear",
            "mkldnn::_linear_pointwise", SMALL_LINEAR_EVENT}  # (ours: a named span)
COPY_OPS = {"aten::copy_", "aten::index_select", "aten::index_copy_", "aten::cat",
            "aten::clone", "aten::contiguous", "aten::_to_copy"}
KINDS = ("matmul", "attention", "copy_gather", "other_aten")


def _counted(event) -> bool:
    return (event.name.startswith(("aten::", "mkldnn::")) or event.name in ATTENTION_OPS
            or event.name == SMALL_LINEAR_EVENT)


def _in_attention(event) -> bool:
    """The op is attention, runs inside an attention op, or is a matmul that batches."""
    if event.name == "aten::matmul" and any(c.name in BATCHED_MATMUL_OPS
                                            for c in event.cpu_children):
        return True
    while event is not None:
        if event.name in ATTENTION_OPS or event.name in BATCHED_MATMUL_OPS:
            return True
        event = event.cpu_parent
    return False


def kind_of(event) -> str:
    if _in_attention(event):
        return "attention"
    if event.name in GEMM_OPS:
        return "matmul"
    return "copy_gather" if event.name in COPY_OPS else "other_aten"


def profile_steps(step: Callable[[], object], num_steps: int) -> dict:
    """Steps under torch.profiler: op self CPU time by kind (see `KINDS`) vs. wall time,
    per step.

    Ops are aten's and oneDNN's, plus the spans around our paged-attention and few-row
    projection kernels; each op
    is classified with its place in the call tree (an op inside SDPA is attention, whatever
    its name). `outside_aten_share` = 1 - (sum of op self time) / wall: Python, dispatch and
    glue. Profiler bookkeeping adds a few us per op, so this share is an upper bound.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            step()
        wall_ms = (time.perf_counter() - start) * 1e3 / num_steps
    by_kind_ms = dict.fromkeys(KINDS, 0.0)
    op_ms: dict[str, float] = {}
    aten_calls = 0
    for event in prof.events():
        if not _counted(event):
            continue
        self_ms = event.self_cpu_time_total / 1e3 / num_steps
        by_kind_ms[kind_of(event)] += self_ms
        op_ms[event.name] = op_ms.get(event.name, 0.0) + self_ms
        aten_calls += 1
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
