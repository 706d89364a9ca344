"""The engine bench's OpenMP wait policy: an explicit step of its run (a child process's
environment), never a side effect of importing it."""

from __future__ import annotations

import os
import subprocess
import sys

from metronome.bench.engine.wait_policy import measuring_policy


def test_importing_the_bench_changes_no_environment_variable():
    code = ("import os; before = dict(os.environ); import metronome.bench.engine_bench; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_bench_measures_passive_unless_the_environment_says_otherwise():
    assert measuring_policy({"HOME": "/root"}) == (
        {"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE (set by the bench)")
    assert measuring_policy({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "7"}) == (
        {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "7"}, "ACTIVE (from the environment)")
    assert measuring_policy({"GOMP_SPINCOUNT": "7"}) == (
        {"GOMP_SPINCOUNT": "7"}, "default (GOMP_SPINCOUNT=7 from the environment)")
