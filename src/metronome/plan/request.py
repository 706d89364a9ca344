"""The question as `metronome plan` is asked it (strings and numbers), resolved once into
`PlanInputs`: the model's shapes, the dtype, the KV budget, the policy, the step cost model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from metronome.kv.residency import ResidencyPolicy
from metronome.plan.budget import kv_budget, model_config, parse_bytes
from metronome.plan.planner import PlanInputs
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.workload_defaults import (
    BLOCK_SIZE_TOKENS,
    DEADLINE_FRACTION,
    FRAME_PERIOD_S,
    INPUT_TOKENS_PER_FRAME,
    OUTPUT_TOKENS_PER_FRAME,
    POLICY_SPEC,
    TARGET_FRACTION,
)


@dataclass(frozen=True)
class PlanRequest:
    model: str = "bundled"
    dtype: str = "bfloat16"  # the KV and weights dtype on the target (bf16 on GPUs)
    block_size: int = BLOCK_SIZE_TOKENS
    pool_tokens: int | None = None
    pool_bytes: str | None = None  # '12GiB'
    gpu_memory: str | None = None  # '80GB': the device's memory; KV = x utilization - weights
    utilization: float = 0.9
    weights_bytes: str | None = None  # None: counted from the model's shapes
    reserve_bytes: str = "0"
    policy: str = POLICY_SPEC
    frame_period_s: float = FRAME_PERIOD_S
    deadline_fraction: float = DEADLINE_FRACTION
    input_tokens: int = INPUT_TOKENS_PER_FRAME
    output_tokens: int = OUTPUT_TOKENS_PER_FRAME
    session_s: float = 3600.0
    step_cost: str | None = None  # a StepCostModel JSON; None: the packaged calibration
    fixed_s: float | None = None  # each overrides the file's constant
    per_token_s: float | None = None
    per_context_token_s: float | None = None
    target_fraction: float = TARGET_FRACTION
    prior_fraction: float = 0.0
    sessions: int | None = None

    def cost_model(self) -> tuple[StepCostModel, str]:
        path = PACKAGED_STEP_COST if self.step_cost is None else Path(self.step_cost)
        if not path.is_file():
            raise ValueError(f"no such step cost file: {path}")
        cost, calibration = StepCostModel.load(path)
        name = "packaged step_cost.json" if self.step_cost is None else str(path)
        source = f"{name}: {calibration.describe()}"
        given = {k: v for k, v in (("fixed_s", self.fixed_s), ("per_token_s", self.per_token_s),
                                   ("per_context_token_s", self.per_context_token_s))
                 if v is not None}
        if given:
            cost = replace(cost, **given)
            source = f"{', '.join(given)} given; the rest from {source}"
        return cost, source

    def inputs(self) -> PlanInputs:
        from metronome.model.dtypes import resolve_dtype

        cfg = model_config(self.model)
        dtype = resolve_dtype(self.dtype)
        budget = kv_budget(
            cfg, dtype, self.block_size, pool_tokens=self.pool_tokens,
            pool_bytes=None if self.pool_bytes is None else parse_bytes(self.pool_bytes),
            gpu_memory_bytes=None if self.gpu_memory is None else parse_bytes(self.gpu_memory),
            utilization=self.utilization,
            weights_bytes=None if self.weights_bytes is None else parse_bytes(
                self.weights_bytes),
            reserve_bytes=parse_bytes(self.reserve_bytes))
        cost, source = self.cost_model()
        return PlanInputs(
            model_name=f"{cfg.name} ({self.dtype})", budget=budget,
            policy=ResidencyPolicy.parse(self.policy), cost=cost, cost_source=source,
            frame_period_s=self.frame_period_s, deadline_fraction=self.deadline_fraction,
            input_tokens=self.input_tokens, output_tokens=self.output_tokens,
            session_s=self.session_s, target_fraction=self.target_fraction,
            prior_fraction=self.prior_fraction, sessions=self.sessions)
