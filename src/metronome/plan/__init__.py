"""Capacity planning (`metronome plan`): how many sessions a model, a KV budget and a step
cost model serve, and which of memory or the deadline binds.

- `plan.budget`: the model's shapes, KV bytes per token, the pool in blocks
- `plan.memory`: blocks per session (exact replay on a `BlockTable`), the memory ceiling, t_sat
- `plan.schedule`: the steps, tokens and keys of one frame
- `plan.deadline`: the deadline ceiling N* under a `StepCostModel`
- `plan.planner`: `PlanInputs` -> `CapacityPlan` (which binds, AIMD advice)
- `plan.request`: the command line's question resolved into `PlanInputs`
- `plan.report`: the rich table
"""

from metronome.plan.planner import CapacityPlan, PlanInputs, make_plan
from metronome.plan.request import PlanRequest

__all__ = ["CapacityPlan", "PlanInputs", "PlanRequest", "make_plan"]
