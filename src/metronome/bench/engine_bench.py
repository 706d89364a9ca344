"""`metronome bench engine`: the entry points of the engine step benchmark. What it measures
and how: `metronome.bench.engine`.

A run is three kinds of process:

    run           this process: chooses the OpenMP wait policy, logs it, starts the child
    measure_main  a child with that policy in its environment: measures, writes engine.json,
                  engine.md and the fitted step cost model, prints the JSON on stdout
    probe_main    the wait-policy probe's children, one per policy: a few rows as JSON

Importing this module changes nothing: OpenMP reads its wait policy once, when torch loads,
so the policy reaches the measurement only through a child's environment
(`metronome.bench.engine.wait_policy`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from metronome.bench.engine.machine import machine
from metronome.bench.engine.measure import Bench, compare_dtypes, measure_flatness, measure_grid
from metronome.bench.engine.plan import make_plan, progress
from metronome.bench.engine.probe import probe_rows, wait_policy_probe
from metronome.bench.engine.report import markdown
from metronome.bench.engine.step_cost import fit_step_cost, step_cost_path
from metronome.bench.engine.summary import summarize
from metronome.bench.engine.wait_policy import measuring_policy, run_child
from metronome.model.dtypes import DTYPES


def run(out_md: str, out_json: str, smoke: bool, repeats: int) -> dict:
    """Measure in a child process under the bench's wait policy; it prints the results as
    JSON and writes them to `out_json` and `out_md`, the step cost model beside them."""
    policy_env, omp_wait_policy = measuring_policy(os.environ)
    settings = " ".join(f"{k}={v}" for k, v in policy_env.items())
    progress(f"OpenMP wait policy {omp_wait_policy}: measuring in a child process with "
             f"{settings}")
    code = ("from metronome.bench.engine_bench import measure_main; "
            f"measure_main({str(out_md)!r}, {str(out_json)!r}, {smoke!r}, {repeats!r}, "
            f"{omp_wait_policy!r})")
    run_child(code, policy_env, capture=False)
    return json.loads(Path(out_json).read_text())


def measure_main(out_md: str, out_json: str, smoke: bool, repeats: int,
                 omp_wait_policy: str) -> None:
    """The measuring child: `omp_wait_policy` names the policy its environment sets."""
    started = time.perf_counter()
    plan = make_plan(smoke, repeats)
    machine_facts = machine(omp_wait_policy)
    bench = Bench(plan)
    dtype_choice = compare_dtypes(bench)
    chosen = dtype_choice["chosen"]
    for dtype in DTYPES:
        if dtype != chosen:
            bench.drop_dtype(dtype)
    measured = {"dtype": dtype_choice, "grid": measure_grid(bench, chosen),
                "flat": measure_flatness(bench, chosen)}
    bench.drop_dtype(chosen)  # the probe's child processes load their own
    measured["wait_policy"] = wait_policy_probe(plan, smoke, chosen)
    results = summarize(plan, measured, machine_facts, smoke)
    results["elapsed_s"] = time.perf_counter() - started
    text = json.dumps(results, indent=1)
    for path, content in ((out_json, text + "\n"), (out_md, markdown(results))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
    cost, calibration = fit_step_cost(results, out_json)
    cost.save(step_cost_path(out_json), calibration)
    progress(f"step cost model {cost} -> {step_cost_path(out_json)}")
    print(text)


def probe_main(smoke: bool, repeats: int, dtype: str) -> None:
    """A wait-policy probe child: the probe rows as JSON on stdout."""
    print(json.dumps(probe_rows(make_plan(smoke, repeats), dtype)))
