"""The wait-policy probe: a few configurations under each OpenMP wait policy, each policy in
its own child process (see `wait_policy`), as the machine was found and with one core busy."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext

from metronome.bench.engine.measure import Bench
from metronome.bench.engine.plan import HF_SYSTEM, KEY_FIELDS, Config, Key, label, progress
from metronome.bench.engine.wait_policy import WAIT_POLICIES, run_child

PROBE_FIELDS = (*KEY_FIELDS, "step_ms_median", "step_ms_min", "load_avg_1m")


def probe_keys(plan: Config, dtype: str) -> list[Key]:
    tokens, sessions = plan.focus_tokens[0], plan.focus_sessions
    return [(dtype, plan.bounded_policy, 1, tokens), (dtype, "unbounded", sessions, tokens),
            (dtype, plan.bounded_policy, sessions, tokens), (dtype, HF_SYSTEM, sessions, tokens)]


def probe_rows(plan: Config, dtype: str) -> list[dict]:
    """What one probe child measures (in its own process, under its own policy)."""
    rows = Bench(plan).side_by_side(probe_keys(plan, dtype))
    return [{f: row[f] for f in PROBE_FIELDS} for row in rows.values()]


@contextmanager
def one_core_busy():
    """Another process spinning on one core: the shared-machine condition, made on purpose."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def probe_child(plan: Config, dtype: str, policy_env: dict) -> list[dict]:
    code = ("from metronome.bench.engine_bench import probe_main; "
            "from metronome.bench.engine.plan import Config; "
            f"probe_main({plan!r}, {dtype!r})")
    return json.loads(run_child(code, policy_env, capture=True))


def wait_policy_probe(plan: Config, dtype: str) -> list[dict]:
    """A few configurations under each OpenMP wait policy, as found and with one core busy.

    Each policy runs in its own child process (the policy is fixed when torch loads);
    the policies alternate within a condition.
    """
    conditions: dict[str, Callable[[], AbstractContextManager]] = {"as found": nullcontext}
    if plan.probe_busy_core:
        conditions["one core busy"] = one_core_busy
    rows = []
    for condition, make_context in conditions.items():
        with make_context():
            for policy, env in WAIT_POLICIES.items():
                for row in probe_child(plan, dtype, env):
                    rows.append({**row, "condition": condition, "wait_policy": policy})
                    key = tuple(row[f] for f in KEY_FIELDS)
                    progress(f"wait policy {policy}, {condition}: {label(key)}: median "
                             f"{row['step_ms_median']:.1f} ms")
    return rows
