"""The OpenMP wait policy of the processes that measure, and how they are started.

OpenMP (libgomp) reads its wait policy once, when torch loads it. Its default (spin, then
sleep) turns a 100 ms step into > 1 s whenever another process holds one of this machine's 2
cores: each of the step's ~1000 parallel regions spins waiting for a descheduled thread.
Passive waiting is robust to that but slower on an idle machine; the bench measures both
(`probe`). Because the policy is fixed at load time, the bench never sets it in its own
process: it measures in a child process started with the policy in its environment
(`measuring_policy`), and each probe policy gets a child of its own. An explicit
OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping

WAIT_POLICY_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
SPIN_ENV = {"GOMP_SPINCOUNT": "300000"}  # libgomp's documented default spin count
WAIT_POLICIES = {"passive": PASSIVE_ENV, "spin": SPIN_ENV}


def measuring_policy(environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The wait-policy variables the measuring child gets, and how the report names them:
    the environment's own if it sets any, else passive (set by the bench)."""
    explicit = {k: environ[k] for k in WAIT_POLICY_KEYS if k in environ}
    if "OMP_WAIT_POLICY" in explicit:
        return explicit, f"{explicit['OMP_WAIT_POLICY']} (from the environment)"
    if explicit:
        spin = explicit["GOMP_SPINCOUNT"]
        return explicit, f"default (GOMP_SPINCOUNT={spin} from the environment)"
    return dict(PASSIVE_ENV), f"{PASSIVE_ENV['OMP_WAIT_POLICY']} (set by the bench)"


def run_child(code: str, policy_env: Mapping[str, str], capture: bool) -> str | None:
    """Run `python -c code` with this environment's wait-policy variables replaced by
    `policy_env`; its stdout if `capture`, else it shares this process's stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_POLICY_KEYS} | dict(policy_env)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=capture,
                          text=True, check=True)
    return done.stdout
