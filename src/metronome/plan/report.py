"""A capacity plan for people: one rich table of the answer and the model behind it."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from metronome.plan.planner import CapacityPlan


def _s(value: float) -> str:
    return "never" if math.isinf(value) else f"{value:,.1f} s"


def plan_table(plan: CapacityPlan) -> Table:
    i = plan.inputs
    table = Table(title=f"metronome plan: {i['model']}, {i['policy']}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    rows = [
        ("KV pool", f"{plan.num_blocks:,} blocks of {i['block_size']} tokens "
                    f"({i['kv_budget']}; {plan.kv_bytes_per_token:,} B per token), "
                    f"{plan.free_blocks:,} free"),
        ("session", f"{i['input_tokens']} in + {i['output_tokens']} out tokens per "
                    f"{i['frame_period_s']:g} s frame, deadline {i['deadline_s']:g} s, "
                    f"{i['session_s']:g} s long"),
        ("step schedule", f"{plan.steps_per_frame} steps and {plan.tokens_per_frame} KV "
                          f"tokens per frame, ~{plan.context_tokens:,.1f} keys per step"),
        ("step cost", f"{_cost(i['cost_model'])}  ({i['cost_model_source']})"),
        ("memory ceiling", f"{plan.memory_ceiling:,} sessions "
                           f"({plan.blocks_per_session} blocks each at their peak); "
                           f"`metronome serve` admits at most {_ceiling(plan)}"),
        ("deadline ceiling N*", f"{plan.deadline_ceiling:,} sessions, independent phases "
                                f"({plan.deadline_ceiling_aligned:,} if every frame arrives "
                                f"at once); p95 target {i['target_fraction']:g} x deadline"),
        ("binds", f"[bold]{plan.binds}[/bold]: capacity {plan.capacity:,} sessions, frame "
                  f"latency there ~{plan.latency_at_capacity_s * 1e3:,.0f} ms"),
        (f"t_sat at N={plan.t_sat_sessions}",
         f"this policy: {_s(plan.t_sat_policy_s)}; if unbounded: "
         f"{_s(plan.t_sat_unbounded_block_level_s)} (block level), "
         f"{_s(plan.t_sat_unbounded_token_level_s)} (token level, (1 - rho0) P / (N r))"),
    ]
    advice = plan.aimd
    rows.append(("AIMD", "no safe cap: see the notes" if advice is None else
                 f"initial cap {advice.initial_cap}, floor (min_cap) {advice.min_cap}, "
                 f"max_cap {advice.max_cap}"))
    rows += [("note", note) for note in plan.notes]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _ceiling(plan: CapacityPlan) -> str:
    if plan.server_admission_ceiling is None:
        return "any number (unbounded: no memory ceiling)"
    return f"{plan.server_admission_ceiling:,} (any chunk up to max_chunk_tokens)"


def _cost(c: dict) -> str:
    return (f"{c['fixed_s'] * 1e3:.2f} ms + {c['per_token_s'] * 1e6:.1f} us/token + "
            f"{c['per_context_token_s'] * 1e6:.3f} us/key")


def print_plan(plan: CapacityPlan, console: Console | None = None) -> None:
    (console or Console()).print(plan_table(plan))
