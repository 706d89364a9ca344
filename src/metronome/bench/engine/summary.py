"""Measured rows -> what the report says: our/transformers ratios, step time against session
length, where the step goes, the wait-policy table, the goals and what limits the step.
Pure functions of the rows (and the plan); the JSON the bench writes is `summarize`'s."""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from datetime import UTC, datetime

from metronome.bench.engine.plan import HF_SYSTEM, KEY_FIELDS, Config, Key, label
from metronome.results.tables import pct, times

OVERHEAD_GOAL_SHARE = 0.10
FLAT_GOAL_SHARE = 0.10
RATIO_GOAL = 0.7


def ok_row(rows: dict[Key, dict], key: Key) -> dict | None:
    row = rows.get(key)
    return row if row is not None and row["status"] == "ok" else None


def ratio_rows(grid: dict[Key, dict], plan: Config, dtype: str) -> list[dict]:
    """Our step time over transformers' for the same (N, L), per policy (median and min)."""
    out = []
    for sessions in plan.sessions:
        for tokens in plan.session_tokens:
            hf = ok_row(grid, (dtype, HF_SYSTEM, sessions, tokens))
            for policy in plan.policies:
                ours = ok_row(grid, (dtype, policy, sessions, tokens))
                if hf and ours:
                    out.append({"sessions": sessions, "session_tokens": tokens, "policy": policy,
                                "ratio_median": ours["step_ms_median"] / hf["step_ms_median"],
                                "ratio_min": ours["step_ms_min"] / hf["step_ms_min"],
                                "side_by_side": bool(ours["side_by_side_with"])
                                and label((dtype, HF_SYSTEM, sessions, tokens))
                                in ours["side_by_side_with"]})
    return out


def flatness_rows(rows: dict[Key, dict], plan: Config, dtype: str, systems: list[str],
                  measured: str) -> list[dict]:
    """Per N and system: step time at each L, absolute and relative to the shortest L."""
    out = []
    for sessions in plan.sessions:
        for system in systems:
            found = [r for t in plan.session_tokens
                     if (r := ok_row(rows, (dtype, system, sessions, t)))]
            if len(found) < 2:
                continue
            first_med, first_min = found[0]["step_ms_median"], found[0]["step_ms_min"]
            out.append({
                "sessions": sessions, "system": system, "measured": measured,
                "session_tokens": [r["session_tokens"] for r in found],
                "step_ms_median": [r["step_ms_median"] for r in found],
                "relative_median": [r["step_ms_median"] / first_med for r in found],
                "relative_min": [r["step_ms_min"] / first_min for r in found],
            })
    return out


def overhead_rows(grid: dict[Key, dict], plan: Config, dtype: str) -> list[dict]:
    """Profile split (and, for ours, the phase split) at the focus configurations."""
    out = []
    for tokens in plan.focus_tokens:
        for system in plan.systems:
            row = ok_row(grid, (dtype, system, plan.focus_sessions, tokens))
            if row and "profile" in row:
                entry = {"sessions": plan.focus_sessions, "session_tokens": tokens,
                         "system": system, "step_ms_median": row["step_ms_median"],
                         "profile": row["profile"]}
                if "phases_ms" in row:
                    phases = row["phases_ms"]
                    entry["phases_ms"] = phases
                    entry["bookkeeping_share"] = phases["bookkeeping_ms"] / phases["sum_ms"]
                out.append(entry)
    return out


def wait_policy_table(rows: list[dict]) -> list[dict]:
    """Per condition and configuration: passive vs spin median step time."""
    by_key = {(r["condition"], r["system"], r["sessions"], r["session_tokens"], r["wait_policy"]):
              r for r in rows}
    out = []
    for (condition, system, sessions, tokens, policy), row in by_key.items():
        spin = by_key.get((condition, system, sessions, tokens, "spin"))
        if policy == "passive" and spin:
            out.append({"condition": condition, "system": system, "sessions": sessions,
                        "session_tokens": tokens, "passive_ms": row["step_ms_median"],
                        "spin_ms": spin["step_ms_median"],
                        "spin_over_passive": spin["step_ms_median"] / row["step_ms_median"],
                        "load_avg_1m": row["load_avg_1m"]})
    return out


def goal_flat(flatness: list[dict], bounded: str) -> dict:
    bounded_dev = [max(abs(x - 1) for x in f["relative_median"])
                   for f in flatness if f["system"] == bounded]
    growth = [f["relative_median"][-1] for f in flatness if f["system"] == "unbounded"]
    # unbounded must grow where attention matters most: the largest N measured at 2+ lengths
    reached = (bool(bounded_dev) and max(bounded_dev) <= FLAT_GOAL_SHARE and bool(growth)
               and growth[-1] > 1 + FLAT_GOAL_SHARE)
    nan = math.nan
    detail = (f"{bounded}: largest deviation from the shortest length "
              f"{pct(max(bounded_dev, default=nan))} over N (median step, all lengths side by "
              f"side); unbounded grows {times(min(growth, default=nan))} to "
              f"{times(max(growth, default=nan))} from shortest to longest length over N "
              f"({times(growth[-1] if growth else nan)} at the largest N)")
    return {"goal": "bounded step time flat (±10 %) from shortest to longest session while "
            "unbounded grows", "reached": reached, "detail": detail}


def goal_ratio(ratios: list[dict], policy: str) -> dict:
    values = [r["ratio_median"] for r in ratios if r["policy"] == policy]
    met = sum(v <= RATIO_GOAL for v in values)
    return {"goal": f"ours ({policy}) ≤ {RATIO_GOAL}× transformers on the same workload",
            "reached": bool(values) and met == len(values),
            "detail": f"{met} of {len(values)} configurations; ratio "
                      f"{times(min(values, default=math.nan))} to "
                      f"{times(max(values, default=math.nan))}"}


def goal_overhead(overhead: list[dict]) -> dict:
    ours = [o for o in overhead if o["system"] != HF_SYSTEM]
    shares = [o["profile"]["outside_aten_share"] for o in ours]
    bookkeeping = [o["bookkeeping_share"] for o in ours]
    nan = math.nan
    return {"goal": f"overhead outside model math ≤ {pct(OVERHEAD_GOAL_SHARE)} at the focus N",
            "reached": bool(shares) and max(shares) <= OVERHEAD_GOAL_SHARE,
            "detail": f"time outside aten ops {pct(min(shares, default=nan))} to "
                      f"{pct(max(shares, default=nan))} of a profiled step; Python "
                      f"bookkeeping (plan + build_batch + finish) "
                      f"{pct(min(bookkeeping, default=nan))} to "
                      f"{pct(max(bookkeeping, default=nan))} of an unprofiled step"}


def limits(grid: dict[Key, dict], dtype: str, overhead: list[dict]) -> list[str]:
    """Where the step time goes, in sentences built from the measured numbers."""
    lines = []
    for o in overhead:
        share = o["profile"]["share_of_wall"]
        row = grid[(dtype, o["system"], o["sessions"], o["session_tokens"])]
        top = ", ".join(f"{name.removeprefix('aten::')} {ms:.1f}"
                        for name, ms in o["profile"]["top_ops_ms"])
        lines.append(
            f"{o['system']}, N={o['sessions']}, L={o['session_tokens']}: copies/gathers "
            f"{pct(share['copy_gather'])} of a profiled step, GEMMs (projections, lm_head) "
            f"{pct(share['matmul'])}, "
            f"attention {pct(share.get('attention', 0.0))}, "
            f"other aten {pct(share['other_aten'])}, outside aten "
            f"{pct(o['profile']['outside_aten_share'])} "
            f"({o['profile']['aten_calls_per_step']:.0f} aten calls per step; profiled steps "
            f"{times(o['profile']['wall_ms'] / o['step_ms_median'])} the timed ones). "
            f"Top ops (self ms per step): {top}. Kernel (sys) "
            f"CPU {pct(row['cpu_sys_share'])} of step CPU time, "
            f"{row['minor_faults_per_step']:.0f} minor page faults per step. A plain matmul "
            f"over the step's linear shapes takes {row['matmul_ref_ms']:.1f} ms "
            f"({pct(row['matmul_ref_ms'] / row['step_ms_median'])} of the median step).")
    return lines


def wait_policy_limits(table: list[dict]) -> list[str]:
    lines = []
    for condition in dict.fromkeys(w["condition"] for w in table):
        ratios = [w["spin_over_passive"] for w in table if w["condition"] == condition]
        lines.append(f"OpenMP wait policy, {condition}: spinning takes {times(min(ratios))} "
                     f"to {times(max(ratios))} the step time of passive waiting (see the table "
                     "above).")
    return lines


def keyed(rows: list[dict]) -> dict[Key, dict]:
    """Rows as the measuring child wrote them (a list) -> by configuration."""
    return {tuple(r[f] for f in KEY_FIELDS): r for r in rows}


def summarize(plan: Config, measured: dict) -> dict:
    """The bench's results (engine.json): the measured rows and everything derived from them.
    `measured` is the measuring child's: rows as lists, the dtype choice, the probe rows."""
    dtype_choice, grid = measured["dtype"], keyed(measured["grid"])
    chosen = dtype_choice["chosen"]
    common = {"config": {**asdict(plan), "policies": list(plan.policies)},
              "systems": plan.systems if not plan.calibration_only else list(plan.policies),
              "dtype": dtype_choice, "grid": measured["grid"],
              "load_avg_1m_end": os.getloadavg()[0],
              "finished_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M")}
    if plan.calibration_only:
        return common
    flat = keyed(measured["flat"])
    flatness = (flatness_rows(flat, plan, chosen, [plan.bounded_policy],
                              "all lengths side by side")
                + flatness_rows(grid, plan, chosen, ["unbounded", HF_SYSTEM],
                                "one length at a time, side by side with the other systems"))
    ratios, overhead = ratio_rows(grid, plan, chosen), overhead_rows(grid, plan, chosen)
    wait_policy = wait_policy_table(measured["wait_policy"])
    return common | {
        "flat": measured["flat"], "ratios": ratios, "flatness": flatness,
        "overhead": overhead, "wait_policy": wait_policy,
        "goals": [goal_flat(flatness, plan.bounded_policy), goal_ratio(ratios, "unbounded"),
                  goal_ratio(ratios, plan.bounded_policy), goal_overhead(overhead)],
        "limits": limits(grid, chosen, overhead) + wait_policy_limits(wait_policy),
    }
