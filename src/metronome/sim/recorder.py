"""Records a run: every frame result and step, then the summary a person reads.

Goodput (frames that produced their output within the deadline) is the honest headline;
it sits next to latency percentiles and deadline misses, which alone can look healthy
while the engine is silently stalled.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from metronome.engine.types import StepOutput
from metronome.stats import percentile
from metronome.stream import Frame, FrameStatus

CSV_FIELDS = ["session_id", "index", "status", "num_tokens", "late_tokens", "arrival_s",
              "start_s", "finish_s", "deadline_at_s", "latency_ms", "deadline_met", "good"]



@dataclass
class StepSample:
    finished_s: float
    step_s: float
    batch_sessions: int
    input_tokens: int
    used_blocks: int
    free_blocks: int
    num_stalled: int


@dataclass
class RunRecorder:
    results: list[Frame] = field(default_factory=list)
    steps: list[StepSample] = field(default_factory=list)

    def on_result(self, result: Frame) -> None:
        self.results.append(result)

    def on_step(self, out: StepOutput) -> None:
        self.steps.append(StepSample(
            out.finished_s, out.step_s, len(out.status), out.num_input_tokens,
            out.pool.used_blocks, out.pool.free_blocks, out.num_stalled,
        ))

    def summary(self) -> dict:
        frames = self.results
        latencies_ms = [r.latency_s * 1e3 for r in frames]
        by_status = {s.value: sum(1 for r in frames if r.status is s) for s in FrameStatus}
        step_ms = [s.step_s * 1e3 for s in self.steps]
        return {
            "frames": len(frames),
            "goodput": sum(r.good for r in frames) / len(frames) if frames else None,
            "deadline_met_fraction": (
                sum(r.deadline_met for r in frames) / len(frames) if frames else None
            ),
            "frames_by_status": by_status,
            "latency_ms": {f"p{q}": percentile(latencies_ms, q) for q in (50, 95, 99)}
            | {"max": max(latencies_ms, default=None)},
            "tokens_per_frame_mean": (
                statistics.fmean(len(r.token_ids) for r in frames) if frames else None
            ),
            "late_tokens": sum(len(r.late_token_ids) for r in frames),
            "steps": len(self.steps),
            "step_ms": {"p50": percentile(step_ms, 50), "p95": percentile(step_ms, 95)},
            "peak_used_blocks": max((s.used_blocks for s in self.steps), default=0),
        }

    def write_csv(self, path: Path) -> None:
        with path.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(CSV_FIELDS)
            for r in self.results:
                writer.writerow([
                    r.session_id, r.index, r.status.value, len(r.token_ids), len(r.late_token_ids),
                    f"{r.arrival_s:.6f}", "" if r.start_s is None else f"{r.start_s:.6f}",
                    f"{r.finish_s:.6f}", f"{r.deadline_at_s:.6f}", f"{r.latency_s * 1e3:.3f}",
                    int(r.deadline_met), int(r.good),
                ])
