"""Where a `VllmEngine`'s time goes, step by step: what vLLM scheduled (decode rows, chunk
rows, tokens), who waited, who was preempted, and how a step's wall time splits between
vLLM's own `step()` (scheduler pass, model run, output update), the adapter's Python around
it, and the caller's time between steps (the beat's or a plain loop's work, and idleness).

`StepProfiler(engine)` wraps the engine's scheduler and step in place (readings only: the
calls are passed through unchanged); `summary()` condenses the rows. `metronome bench vllm
--profile` attaches one to every vLLM arm.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass

from metronome.stats import percentile


@dataclass
class StepRow:
    start_s: float  # when `VllmEngine.step()` was entered, since the profiler started
    step_ms: float  # the whole `VllmEngine.step()`
    vllm_ms: float  # inside vLLM's engine-core step (schedule + model run + update)
    schedule_ms: float  # of which the scheduler's pass
    decode_rows: int  # requests scheduled one token this step
    chunk_rows: int  # requests scheduled more than one
    tokens: int  # tokens scheduled, all requests
    running: int  # requests running after the scheduler's pass
    waiting: int  # requests waiting to be placed (input given, not scheduled: not idle ones)
    idle: int  # requests between chunks (waiting for their session's next input)
    preempted: int  # requests preempted in this step's pass


class StepProfiler:
    """Per-step readings of one `VllmEngine` (see the module docstring)."""

    def __init__(self, engine) -> None:
        from vllm.v1.request import RequestStatus

        self.rows: list[StepRow] = []
        self.torch_threads: int | None = None
        self.started_s = time.perf_counter()
        self._pending: dict = {}
        scheduler, core = engine.scheduler, engine.llm.engine_core
        schedule, preempt, get_output, step = (
            scheduler.schedule, scheduler._preempt_request, core.get_output, engine.step)
        waiting_states = {RequestStatus.WAITING, RequestStatus.PREEMPTED}

        def timed_schedule(*args, **kwargs):
            began = time.perf_counter()
            out = schedule(*args, **kwargs)
            counts = Counter(r.status for r in scheduler.requests.values())
            scheduled = out.num_scheduled_tokens
            self._pending.update(
                schedule_ms=(time.perf_counter() - began) * 1e3,
                decode_rows=sum(1 for n in scheduled.values() if n == 1),
                chunk_rows=sum(1 for n in scheduled.values() if n > 1),
                tokens=sum(scheduled.values()), running=counts[RequestStatus.RUNNING],
                waiting=sum(counts[s] for s in waiting_states),
                idle=counts[RequestStatus.WAITING_FOR_STREAMING_REQ])
            return out

        def counted_preempt(*args, **kwargs):
            self._pending["preempted"] = self._pending.get("preempted", 0) + 1
            return preempt(*args, **kwargs)

        def timed_get_output(*args, **kwargs):
            began = time.perf_counter()
            out = get_output(*args, **kwargs)
            self._pending["vllm_ms"] = (time.perf_counter() - began) * 1e3
            return out

        def timed_step():
            if not self.rows:  # the thread that steps: how many torch threads it runs
                import torch

                self.torch_threads = torch.get_num_threads()
            self._pending = {}
            began = time.perf_counter()
            out = step()
            p = self._pending
            self.rows.append(StepRow(
                began - self.started_s, (time.perf_counter() - began) * 1e3,
                p.get("vllm_ms", 0.0), p.get("schedule_ms", 0.0), p.get("decode_rows", 0),
                p.get("chunk_rows", 0), p.get("tokens", 0), p.get("running", 0),
                p.get("waiting", 0), p.get("idle", 0), p.get("preempted", 0)))
            return out

        scheduler.schedule = timed_schedule
        scheduler._preempt_request = counted_preempt
        core.get_output = timed_get_output
        engine.step = timed_step

    def summary(self, skip_s: float = 0.0) -> dict:
        """The rows from `skip_s` on (a warm-up left out), condensed."""
        rows = [r for r in self.rows if r.start_s >= skip_s]
        if len(rows) < 2:
            return {"steps": len(rows)}
        span_s = rows[-1].start_s + rows[-1].step_ms / 1e3 - rows[0].start_s
        busy = [r for r in rows if r.tokens]

        def dist(values: list[float]) -> dict:
            values = sorted(values)
            return {"p50": percentile(values, 50), "p95": percentile(values, 95),
                    "max": values[-1] if values else None,
                    "mean": statistics.fmean(values) if values else None}

        gaps_ms = [(b.start_s - a.start_s) * 1e3 - a.step_ms
                   for a, b in zip(rows, rows[1:], strict=False)]
        return {
            "steps": len(rows), "torch_threads": self.torch_threads, "span_s": span_s,
            "steps_per_s": len(rows) / span_s,
            "empty_steps": len(rows) - len(busy),
            "step_ms": dist([r.step_ms for r in busy]),
            "vllm_ms": dist([r.vllm_ms for r in busy]),
            "schedule_ms": dist([r.schedule_ms for r in busy]),
            "adapter_ms": dist([r.step_ms - r.vllm_ms for r in busy]),
            "between_steps_ms": dist(gaps_ms),
            # shares of the span: inside vLLM's step, the adapter around it, between steps
            "share_vllm": sum(r.vllm_ms for r in rows) / 1e3 / span_s,
            "share_adapter": sum(r.step_ms - r.vllm_ms for r in rows) / 1e3 / span_s,
            "share_between": sum(gaps_ms) / 1e3 / span_s,
            "decode_rows": dist([r.decode_rows for r in busy]),
            "chunk_rows": dist([r.chunk_rows for r in busy]),
            "tokens": dist([r.tokens for r in busy]),
            "waiting": dist([r.waiting for r in rows]),
            "steps_with_waiting": sum(1 for r in rows if r.waiting),
            "preempted": sum(r.preempted for r in rows),
        }

    def rows_as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.rows]
