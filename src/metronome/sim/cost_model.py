"""Step cost model for the virtual clock: what one engine step would take on a machine.

    step_s = fixed_s + per_token_s * input_tokens + per_context_token_s * sum(context_tokens)

`input_tokens` drive the weight matmuls, `context_tokens` (keys each session's chunk
attends to) drive KV gathers and attention. `calibrate` fits the constants by least squares
from real steps of a real engine, so virtual-clock experiments inherit that machine's shape.

A fitted model is stored as a small JSON file (`save` / `load`): the three constants and a
`Calibration` saying where, on what and by which command they were measured.
`PACKAGED_STEP_COST` ships with the package: `metronome bench engine`'s SmolLM2 decode steps
(docs/results/engine.json) on the project's 2-core CPU (its calibration says which); each
bench run writes its own beside its results.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from metronome.engine.types import StepOutput
from metronome.stream import Stream

PACKAGED_STEP_COST = Path(__file__).with_name("step_cost.json")


@dataclass(frozen=True)
class Calibration:
    """Where a cost model's constants were measured, and how; stored beside them. Files
    written before the command, engine path and commit were recorded load with None there."""

    source: str  # the result fitted, e.g. "docs/results/engine.json"
    machine: str  # CPU model and logical CPUs
    date: str  # when the measurement finished, UTC
    dtype: str  # the model dtype of the measured steps, as resolved
    command: str | None = None  # the command that measured it, e.g. "metronome bench engine"
    engine_path: str | None = None  # the engine path as it ran (see metronome bench engine)
    commit: str | None = None  # the git commit measured at ("-dirty": with local changes)

    def describe(self) -> str:
        def known(value: str | None) -> str:
            return "unknown" if value is None else value

        return (f"{self.source} (command {known(self.command)}), {self.machine}, {self.dtype}, "
                f"engine path {known(self.engine_path)}, commit {known(self.commit)}, "
                f"{self.date}")


@dataclass(frozen=True)
class StepCostModel:
    fixed_s: float = 0.004
    per_token_s: float = 0.0008
    per_context_token_s: float = 2e-6

    def step_s(self, out: StepOutput) -> float:
        tokens = out.num_input_tokens
        context = sum(out.context_tokens.values())
        return self.fixed_s + self.per_token_s * tokens + self.per_context_token_s * context

    @classmethod
    def fit(cls, samples: list[tuple[int, int, float]]) -> StepCostModel:
        """samples: (input_tokens, context_tokens, measured step_s) -> non-negative fit."""
        a = torch.tensor([[1.0, t, c] for t, c, _ in samples], dtype=torch.float64)
        b = torch.tensor([[s] for _, _, s in samples], dtype=torch.float64)
        coef = torch.linalg.lstsq(a, b).solution.clamp(min=0).flatten().tolist()
        return cls(fixed_s=coef[0], per_token_s=coef[1], per_context_token_s=coef[2])

    def save(self, path: str | Path, calibration: Calibration) -> None:
        """Write the constants and their calibration as JSON (floats round-trip exactly)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        record = asdict(self) | {"calibration": asdict(calibration)}
        Path(path).write_text(json.dumps(record, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> tuple[StepCostModel, Calibration]:
        """A model written by `save`, and where its constants were measured."""
        record = json.loads(Path(path).read_text())
        calibration = Calibration(**record.pop("calibration"))
        return cls(**record), calibration


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
    sids = [engine.open_session(Stream(f"calibrate-{i}")) for i in range(batch)]
    for sid in sids:
        engine.fast_forward(sid, length)
    timed = []
    for _ in range(repeats + 1):
        for sid in sids:
            engine.submit(sid, [1] * chunk)
        started = time.perf_counter()
        out = engine.step()
        step_s = time.perf_counter() - started
        timed.append((out.num_input_tokens, sum(out.context_tokens.values()), step_s))
    for sid in sids:
        engine.close(sid)
    return min(timed[1:], key=lambda sample: sample[2])  # timed[0] warmed up
