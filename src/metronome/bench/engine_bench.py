"""`metronome bench engine`: the engine step benchmark, and the step cost calibration the
virtual clock runs on (written beside the JSON as `<name>_step_cost.json`; the packaged
`sim/step_cost.json` is a copy of one). What it measures and how: `metronome.bench.engine`.

A run is three kinds of process:

    run           this process: chooses the OpenMP wait policy, starts the measuring child,
                  then summarizes its rows and fits the step cost model
    measure_main  a child with that policy in its environment: measures, writing its rows
                  to a file as each stage finishes (what an interrupted run keeps)
    probe_main    the wait-policy probe's children, one per policy: a few rows as JSON

Importing this module changes nothing: OpenMP reads its wait policy once, when torch loads,
so the policy reaches the measurement only through a child's environment
(`metronome.bench.engine.wait_policy`). `calibration_only` measures just the rows the cost
model is fitted from.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from metronome.bench.engine.plan import Config
from metronome.bench.engine.report import markdown
from metronome.results.context import RunContext

NAME = "engine"


def run(ctx: RunContext, cfg: Config) -> dict:
    """Measure in a child process under the bench's wait policy, then derive the results
    and write the step cost model beside the JSON."""
    from metronome.bench.engine.facts import BUNDLED_MODEL
    from metronome.bench.engine.step_cost import calibration, fit_step_cost, step_cost_path
    from metronome.bench.engine.summary import summarize
    from metronome.bench.engine.wait_policy import measuring_policy, run_child
    from metronome.results.provenance import provenance

    policy_env, omp_wait_policy = measuring_policy(os.environ)
    ctx.record(model=BUNDLED_MODEL, omp_wait_policy=omp_wait_policy)
    settings = " ".join(f"{k}={v}" for k, v in policy_env.items())
    ctx.log(f"OpenMP wait policy {omp_wait_policy}: measuring in a child process with "
            f"{settings}")
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "measured.json"
        code = ("from metronome.bench.engine_bench import measure_main; "
                "from metronome.bench.engine.plan import Config; "
                f"measure_main({cfg!r}, {str(rows_path)!r})")
        try:
            run_child(code, policy_env, capture=False)
        finally:  # what the child finished survives it, in the partial JSON if it died
            measured = json.loads(rows_path.read_text()) if rows_path.exists() else {}
            for key, value in measured.items():
                ctx.keep(key, value)
    ctx.record(dtype=measured["dtype"]["chosen"], engine_path=measured["engine_path"],
               transformers=measured["transformers"])
    results = summarize(cfg, measured)
    cost = fit_step_cost(results["grid"], results["dtype"]["chosen"])
    cost_path = step_cost_path(ctx.out_json)
    fitted = calibration(ctx.out_json, provenance(**ctx.facts), ctx.command,
                         f"{results['finished_utc']} UTC")
    cost.save(cost_path, fitted)
    ctx.log(f"step cost model {cost} -> {cost_path}")
    return results | {"step_cost": {"path": str(cost_path), "fixed_s": cost.fixed_s,
                                    "per_token_s": cost.per_token_s,
                                    "per_context_token_s": cost.per_context_token_s,
                                    "calibration": fitted.describe()}}


def report(result: dict) -> str:
    return markdown(result)


def measure_main(cfg: Config, rows_path: str) -> None:
    """The measuring child: writes what it measured to `rows_path` after each stage."""
    import transformers

    from metronome.bench.engine.facts import dtype_name, engine_path
    from metronome.bench.engine.measure import Bench, compare_dtypes, measure_flatness, measure_grid
    from metronome.bench.engine.probe import wait_policy_probe
    from metronome.model.dtypes import DTYPES, resolve_dtype

    measured: dict = {"transformers": transformers.__version__}

    def keep(key: str, value) -> None:
        measured[key] = value
        Path(rows_path).write_text(json.dumps(measured))

    bench = Bench(cfg)
    if cfg.calibration_only:
        chosen = dtype_name(resolve_dtype("auto"))
        keep("dtype", {"chosen": chosen, "rule": "what `auto` resolves to on this CPU (the "
                       "dtype served by default)", "ours_geomean_step_ms": {}, "rows": []})
    else:
        keep("dtype", compare_dtypes(bench))
        chosen = measured["dtype"]["chosen"]
    for dtype in DTYPES:
        if dtype != chosen:
            bench.drop_dtype(dtype)
    keep("engine_path", engine_path("fast", bench.model(chosen)))
    keep("grid", list(measure_grid(bench, chosen).values()))
    if cfg.calibration_only:
        return
    keep("flat", list(measure_flatness(bench, chosen).values()))
    bench.drop_dtype(chosen)  # the probe's child processes load their own
    keep("wait_policy", wait_policy_probe(cfg, chosen))


def probe_main(cfg: Config, dtype: str) -> None:
    """A wait-policy probe child: the probe rows as JSON on stdout."""
    from metronome.bench.engine.probe import probe_rows

    print(json.dumps(probe_rows(cfg, dtype)))
