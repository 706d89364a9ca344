"""The deadline side of a capacity plan: the largest N whose frames still meet the deadline
under a step cost model. Pure arithmetic.

Step cost (`runtime.cost_model.StepCostModel`): step_s = f + a * tokens + c * context, summed
over the sessions in the step. Per frame a session takes s steps, feeds k + m tokens and
reads about C keys in each step (`plan.schedule`), so its work per frame, beyond the steps'
fixed cost, is

    w = a * (k + m) + c * s * C

Two phase assumptions, both evaluated:

* independent phases (the default; what real clients and the harness's spread arrivals do):
  frames arrive at unrelated moments, so in steady state the engine steps back to back and
  each step does the work that arrived during it: tau = f + (N / P) * w * tau, i.e. a mean
  step of tau = f / (1 - N w / P) (P: the frame period). A frame waits for the step in
  progress (at most tau) and then takes its s steps: latency ~ (s + 1) tau. The deadline
  holds while (s + 1) tau <= q D (q: the target fraction, D: the deadline), so

      N* = floor( (P / w) * (1 - (s + 1) f / (q D)) )

* aligned phases (every session's frame arrives at the same instant, e.g. after a
  synchronized start): one batched step per schedule position, latency s f + N w, so

      N*_aligned = floor( (q D - s f) / w )

Both are 0 when even one session misses. The admission controller's target is the same
q (AIMD's `target_fraction`, p95 by default), so N* is what it should settle at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from metronome.plan.schedule import FrameSchedule
from metronome.sim.cost_model import StepCostModel


@dataclass(frozen=True)
class DeadlineModel:
    cost: StepCostModel
    schedule: FrameSchedule
    context_tokens: float  # C: keys each step's query attends to
    frame_period_s: float  # P
    deadline_s: float  # D
    target_fraction: float  # q

    @property
    def work_per_frame_s(self) -> float:
        """w: one session's per-token and per-key step time for one frame."""
        s = self.schedule
        return (self.cost.per_token_s * s.tokens_written
                + self.cost.per_context_token_s * s.num_steps * self.context_tokens)

    @property
    def budget_s(self) -> float:
        return self.target_fraction * self.deadline_s

    def step_s(self, num_sessions: int) -> float:
        """tau: the mean step with independent phases (inf once the engine cannot keep up)."""
        load = num_sessions * self.work_per_frame_s / self.frame_period_s
        return math.inf if load >= 1 else self.cost.fixed_s / (1 - load)

    def latency_s(self, num_sessions: int) -> float:
        """Frame latency with independent phases: (s + 1) tau."""
        return (self.schedule.num_steps + 1) * self.step_s(num_sessions)

    def latency_aligned_s(self, num_sessions: int) -> float:
        """Frame latency with aligned phases: s f + N w."""
        return (self.schedule.num_steps * self.cost.fixed_s
                + num_sessions * self.work_per_frame_s)

    def n_star(self) -> int:
        fixed = (self.schedule.num_steps + 1) * self.cost.fixed_s / self.budget_s
        return _floor_sessions(self.frame_period_s / self.work_per_frame_s * (1 - fixed))

    def n_star_aligned(self) -> int:
        spare_s = self.budget_s - self.schedule.num_steps * self.cost.fixed_s
        return _floor_sessions(spare_s / self.work_per_frame_s)


def _floor_sessions(n: float) -> int:
    # a hair of slack so a ceiling that is exactly an integer is not lost to rounding
    return max(0, math.floor(n + 1e-9))
