"""Step cost model for the virtual clock: what one engine step would take on a machine.

    step_s = fixed_s + per_token_s * input_tokens + per_context_token_s * sum(context_tokens)

`input_tokens` drive the weight matmuls, `context_tokens` (keys each session's chunk
attends to) drive KV gathers and attention. `calibrate` fits the constants by least squares
from real steps of a real engine, so virtual-clock experiments inherit that machine's shape.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from metronome.engine.types import StepResult


@dataclass(frozen=True)
class StepCostModel:
    fixed_s: float = 0.004
    per_token_s: float = 0.0008
    per_context_token_s: float = 2e-6

    def step_s(self, result: StepResult) -> float:
        tokens = sum(s.input_tokens for s in result.sessions)
        context = sum(s.context_tokens for s in result.sessions)
        return self.fixed_s + self.per_token_s * tokens + self.per_context_token_s * context

    @classmethod
    def fit(cls, samples: list[tuple[int, int, float]]) -> StepCostModel:
        """samples: (input_tokens, context_tokens, measured step_s) -> non-negative fit."""
        a = torch.tensor([[1.0, t, c] for t, c, _ in samples], dtype=torch.float64)
        b = torch.tensor([[s] for _, _, s in samples], dtype=torch.float64)
        coef = torch.linalg.lstsq(a, b).solution.clamp(min=0).flatten().tolist()
        return cls(fixed_s=coef[0], per_token_s=coef[1], per_context_token_s=coef[2])


def from_engine_bench(path: str | Path) -> StepCostModel:
    """Fit from `metronome bench engine` JSON: our decode steps (not transformers'), in the
    dtype the bench chose: input tokens = N, context = N x attended keys per session."""
    data = json.loads(Path(path).read_text())
    dtype = data["dtype"]["chosen"]
    samples = [
        (row["sessions"], row["sessions"] * row["attended_tokens"], row["step_ms_median"] / 1e3)
        for row in data["grid"]
        if row.get("status") == "ok" and row["system"] != "transformers"
        and row.get("dtype", dtype) == dtype
    ]
    if len(samples) < 3:
        raise ValueError(f"{path}: too few engine rows to fit a cost model")
    return StepCostModel.fit(samples)


def calibrate(engine, batch_sizes=(1, 8), lengths=(64, 512), chunks=(1, 16), repeats: int = 3):
    """Time real steps of `engine` at a few shapes (decode and short prefill chunks) and fit a
    `StepCostModel`. Each shape keeps its fastest repeat: on a shared machine the minimum is
    the step's own cost, the rest is other processes' noise."""
    samples = []
    for batch in batch_sizes:
        for length in lengths:
            for chunk in chunks:
                samples.append(_time_shape(engine, batch, length, chunk, repeats))
    return StepCostModel.fit(samples), samples


def _time_shape(engine, batch: int, length: int, chunk: int, repeats: int):
    sids = [engine.open_session() for _ in range(batch)]
    for sid in sids:
        engine.fast_forward(sid, length)
    timed = []
    for _ in range(repeats + 1):
        for sid in sids:
            engine.submit(sid, [1] * chunk)
        started = time.perf_counter()
        result = engine.step()
        step_s = time.perf_counter() - started
        tokens = sum(s.input_tokens for s in result.sessions)
        context = sum(s.context_tokens for s in result.sessions)
        timed.append((tokens, context, step_s))
    for sid in sids:
        engine.close(sid)
    return min(timed[1:], key=lambda sample: sample[2])  # timed[0] warmed up
