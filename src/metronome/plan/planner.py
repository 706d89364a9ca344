"""The capacity plan: from a model, a KV budget, a session profile and a step cost model to
the memory ceiling, the deadline ceiling N*, which binds, when a pool of unbounded sessions
runs dry, and where to start and floor the AIMD admission cap.

`PlanInputs` is the one validated description of the question; `make_plan` answers it with
a `CapacityPlan` (plain numbers, `to_dict` for JSON). The arithmetic lives in
`plan.memory`, `plan.schedule` and `plan.deadline`; this module only wires it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from metronome.engine.engine import EngineConfig, memory_ceiling
from metronome.kv.residency import ResidencyPolicy
from metronome.plan.budget import KvBudget
from metronome.plan.deadline import DeadlineModel
from metronome.plan.memory import (
    ceil_div,
    peak_blocks,
    sessions_that_fit,
    t_sat_block_level_s,
    t_sat_token_level_s,
)
from metronome.plan.schedule import FrameSchedule, mean_visible_context_tokens
from metronome.sim.cost_model import StepCostModel
from metronome.workload_defaults import (
    DEADLINE_FRACTION,
    FRAME_PERIOD_S,
    INPUT_TOKENS_PER_FRAME,
    OUTPUT_TOKENS_PER_FRAME,
    TARGET_FRACTION,
)


@dataclass(frozen=True)
class PlanInputs:
    model_name: str
    budget: KvBudget
    policy: ResidencyPolicy
    cost: StepCostModel
    cost_source: str
    frame_period_s: float = FRAME_PERIOD_S
    deadline_fraction: float = DEADLINE_FRACTION
    input_tokens: int = INPUT_TOKENS_PER_FRAME
    output_tokens: int = OUTPUT_TOKENS_PER_FRAME
    session_s: float = 3600.0  # the server's max_session_s
    max_chunk_tokens: int = 64  # EngineConfig.max_chunk_tokens
    max_step_tokens: int = 4096  # EngineConfig.max_step_tokens
    target_fraction: float = TARGET_FRACTION  # AIMD's: p95 latency <= target x deadline
    prior_fraction: float = 0.0  # rho0: share of the pool others hold at the start
    sessions: int | None = None  # N for t_sat; None: the planned capacity

    def __post_init__(self) -> None:
        if self.frame_period_s <= 0 or self.deadline_fraction <= 0 or self.session_s <= 0:
            raise ValueError(f"frame period, deadline fraction and session length must be "
                             f"positive, got {self.frame_period_s}, {self.deadline_fraction}, "
                             f"{self.session_s}")
        if not 0 <= self.prior_fraction < 1 or not 0 < self.target_fraction <= 1:
            raise ValueError(f"need 0 <= prior_fraction < 1 and 0 < target_fraction <= 1, "
                             f"got {self.prior_fraction}, {self.target_fraction}")
        if self.sessions is not None and self.sessions < 1:
            raise ValueError(f"sessions must be >= 1, got {self.sessions}")
        if self.schedule.tokens_written and (
                self.cost.per_token_s <= 0 and self.cost.per_context_token_s <= 0):
            raise ValueError("the step cost model charges nothing per session: no deadline "
                             "ceiling to find")

    @property
    def schedule(self) -> FrameSchedule:
        return FrameSchedule(self.input_tokens, self.output_tokens, self.max_chunk_tokens)

    @property
    def deadline_s(self) -> float:
        return self.frame_period_s * self.deadline_fraction

    @property
    def frames_per_session(self) -> int:
        return max(1, int(self.session_s / self.frame_period_s))  # as runtime.workload


@dataclass(frozen=True)
class AimdAdvice:
    initial_cap: int  # where AIMD starts: safe under both phase assumptions and in memory
    min_cap: int  # its floor: half of that, room for a cost model 2x optimistic
    max_cap: int  # its ceiling: the memory ceiling (AIMD cannot see memory before it stalls)


@dataclass(frozen=True)
class CapacityPlan:
    inputs: dict
    kv_bytes_per_token: int
    num_blocks: int
    free_blocks: int
    rate_tokens_per_s: float
    steps_per_frame: int
    tokens_per_frame: int
    blocks_per_session: int  # bounded: the peak; unbounded: at the end of the session
    memory_ceiling: int  # this profile's sessions, at their exact peak
    # what `metronome serve`'s admission enforces: any profile's peak (a full
    # max_chunk_tokens chunk) over the whole pool; None: unbounded, it admits into the wall
    server_admission_ceiling: int | None
    context_tokens: float
    work_per_frame_s: float
    deadline_ceiling: int  # N*, independent phases
    deadline_ceiling_aligned: int
    binds: str  # memory | deadline | both
    capacity: int
    t_sat_sessions: int
    t_sat_unbounded_token_level_s: float
    t_sat_unbounded_block_level_s: float
    t_sat_policy_s: float  # the chosen policy: inf when its sessions' peaks fit
    cliff_within_session: bool
    aimd: AimdAdvice | None
    latency_at_capacity_s: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: _json_number(v) for k, v in asdict(self).items()}


def make_plan(p: PlanInputs) -> CapacityPlan:
    schedule, budget = p.schedule, p.budget
    frames = p.frames_per_session
    session_tokens = schedule.tokens_written * frames
    held = math.ceil(p.prior_fraction * budget.num_blocks)
    free = budget.num_blocks - held
    if p.policy.bounded:
        per_session = peak_blocks(p.policy, budget.block_size, schedule.chunks, frames)
    else:
        per_session = ceil_div(session_tokens, budget.block_size)
    memory = sessions_that_fit(free, per_session)
    engine = EngineConfig(block_size=budget.block_size, max_chunk_tokens=p.max_chunk_tokens,
                          max_step_tokens=p.max_step_tokens)
    server = memory_ceiling(p.policy, engine, budget.num_blocks)
    context = mean_visible_context_tokens(p.policy, budget.block_size, session_tokens)
    deadline = DeadlineModel(p.cost, schedule, context, p.frame_period_s, p.deadline_s,
                             p.target_fraction)
    n_star, n_aligned = deadline.n_star(), deadline.n_star_aligned()
    capacity = min(memory, n_star)
    binds = "both" if memory == n_star else ("memory" if memory < n_star else "deadline")
    n_sat = p.sessions or max(1, capacity)
    rate = schedule.tokens_written / p.frame_period_s
    sat_policy = t_sat_block_level_s(free, budget.block_size, n_sat, rate,
                                     per_session if p.policy.bounded else None)
    return CapacityPlan(
        inputs=_inputs_dict(p), kv_bytes_per_token=budget.bytes_per_token,
        num_blocks=budget.num_blocks, free_blocks=free, rate_tokens_per_s=rate,
        steps_per_frame=schedule.num_steps, tokens_per_frame=schedule.tokens_written,
        blocks_per_session=per_session, memory_ceiling=memory,
        server_admission_ceiling=server,
        context_tokens=context,
        work_per_frame_s=deadline.work_per_frame_s, deadline_ceiling=n_star,
        deadline_ceiling_aligned=n_aligned, binds=binds, capacity=capacity,
        t_sat_sessions=n_sat,
        t_sat_unbounded_token_level_s=t_sat_token_level_s(
            p.prior_fraction, budget.pool_tokens, n_sat, rate),
        t_sat_unbounded_block_level_s=t_sat_block_level_s(
            free, budget.block_size, n_sat, rate, None),
        t_sat_policy_s=sat_policy, cliff_within_session=sat_policy < p.session_s,
        aimd=_aimd_advice(memory, n_star, n_aligned),
        latency_at_capacity_s=deadline.latency_s(max(1, capacity)),
        notes=_notes(p, n_star, memory, server),
    )


def _aimd_advice(memory: int, n_star: int, n_aligned: int) -> AimdAdvice | None:
    initial = min(memory, n_star, n_aligned)
    if memory < 1 or initial < 1:
        return None
    return AimdAdvice(initial_cap=initial, min_cap=max(1, initial // 2), max_cap=memory)


def _notes(p: PlanInputs, n_star: int, memory: int, server: int | None) -> list[str]:
    notes = []
    if server is not None and server < min(n_star, memory):
        notes.append(f"`metronome serve` admits at most {server}, below this profile's "
                     f"capacity {min(n_star, memory)}: its memory ceiling reserves a full "
                     f"{p.max_chunk_tokens}-token chunk per session")
    if memory < 1:
        notes.append("no session fits the KV pool for its whole length")
    if n_star < 1:
        notes.append("even one session misses the deadline under this step cost model")
    widest = max(p.schedule.chunks)
    if min(n_star, memory) * widest > p.max_step_tokens:
        notes.append(f"at capacity a step would feed more than max_step_tokens "
                     f"({p.max_step_tokens}); the engine splits it over more steps, which "
                     "this model does not count")
    if not p.policy.bounded:
        notes.append("unbounded: the deadline ceiling is for the longest context, at the end "
                     "of the session")
    return notes


def _inputs_dict(p: PlanInputs) -> dict:
    return {
        "model": p.model_name, "kv_budget": p.budget.source, "policy": str(p.policy),
        "block_size": p.budget.block_size, "frame_period_s": p.frame_period_s,
        "deadline_s": p.deadline_s, "input_tokens": p.input_tokens,
        "output_tokens": p.output_tokens, "session_s": p.session_s,
        "max_chunk_tokens": p.max_chunk_tokens, "target_fraction": p.target_fraction,
        "prior_fraction": p.prior_fraction, "cost_model": asdict(p.cost),
        "cost_model_source": p.cost_source,
    }


def _json_number(value):
    """JSON has no Infinity: 'never' for an infinite time, recursively."""
    if isinstance(value, float) and math.isinf(value):
        return "never"
    if isinstance(value, dict):
        return {k: _json_number(v) for k, v in value.items()}
    return value
