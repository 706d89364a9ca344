"""`metronome bench admission`: the AIMD controller against the offline N* sweep.

1. Virtual clock (deterministic): engine steps are real steps of our engine on a tiny random
   Llama; step *time* comes from the cost model fitted from `metronome bench engine`
   (SmolLM2, this CPU), so the latency curve is SmolLM2's. Bounded (sinks_window 4+128):
   offline sweep for N* (largest N with steady p95 latency <= 0.8 x deadline), then AIMD
   with sessions arriving faster than capacity. Unbounded with a pool that fills: the same
   controller over-admits while latency is flat, then sessions stall.
2. Wall clock on the real SmolLM2 (bf16): AIMD with arrivals faster than capacity.
Writes JSON, PNG plots and `docs/results/admission.md`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from metronome.admission.controller import AdmissionController
from metronome.admission.limits import AIMDLimit
from metronome.results.plots import plot_cap_history
from metronome.sim.admission import log, summarize, virtual_runs
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel


async def _wall_run(duration_s: float, arrival_every_s: float, engine_path: str = "fast"
                    ) -> dict:
    from metronome.engine.engine import Engine, EngineConfig, for_engine_path
    from metronome.kv.residency import ResidencyPolicy
    from metronome.model.dtypes import resolve_dtype
    from metronome.model.weights import load_model, load_tokenizer
    from metronome.runtime.ports import Listeners
    from metronome.runtime.profile import SessionProfile
    from metronome.runtime.wall import WallDriver
    from metronome.sim.local import text_source
    from metronome.sim.recorder import RunRecorder
    from metronome.sim.workload import Workload, schedule

    model = load_model("bundled", resolve_dtype("auto"))
    engine = Engine(model, for_engine_path(model, EngineConfig(block_size=16, pool_tokens=65536),
                                           engine_path))
    engine.warm_up()
    recorder = RunRecorder()
    controller = AdmissionController(AIMDLimit(initial_cap=2), lambda: len(driver.beat.sessions))
    driver = WallDriver(engine, Listeners.of(recorder, controller))
    results = recorder.results
    profile = SessionProfile(frame_period_s=1.0, max_output_tokens_per_frame=4,
                             policy=ResidencyPolicy.sinks_window(4, 128))
    workload = Workload(int(duration_s / arrival_every_s), 30.0, arrival_spread_s=duration_s,
                        duration_jitter=0.3)
    source = text_source(load_tokenizer(), model.config.vocab_size, 12)
    schedule(workload, profile, driver.beat, driver.timer, source, gate=controller.try_admit)
    controller.start(driver.timer)
    try:
        while driver.now_s() < duration_s:
            await asyncio.sleep(5)
            last = controller.history[-1] if controller.history else None
            log(f"wall ({engine_path}): t={driver.now_s():.0f}s cap={last and last.cap} "
                f"active={len(driver.beat.sessions)} frames={len(results)}")
    finally:
        driver.close()

    class Run:  # the shape summarize() reads
        history, counts, saturated_at_s = controller.history, dict(controller.counts), None

    Run.results = results
    return summarize(Run, None, duration_s / 2)


def run(out_md: str, out_json: str, smoke: bool, wall: bool = True,
        compare_reference: bool = False) -> dict:
    started = time.time()
    cost, calibration = StepCostModel.load(PACKAGED_STEP_COST)
    results = {"cost_model": vars(cost), "cost_model_source": calibration.describe(),
               "virtual": virtual_runs(cost, smoke)}
    if wall:
        log("wall clock: SmolLM2, AIMD, arrivals faster than capacity")
        results["wall"] = asyncio.run(_wall_run(40.0 if smoke else 150.0, 0.5))
        if compare_reference:
            log("wall clock again on the engine's reference path (dense attention, F.linear)")
            results["wall_reference"] = asyncio.run(
                _wall_run(40.0 if smoke else 150.0, 0.5, "reference"))
    figures = Path(out_md).with_suffix("")
    figures.mkdir(parents=True, exist_ok=True)
    v = results["virtual"]
    plot_cap_history("virtual clock, bounded (sinks_window 4+128)", v["bounded"],
                     v["bounded"]["n_star"], figures / "virtual_bounded.png")
    plot_cap_history("virtual clock, unbounded KV, pool fills", v["unbounded"], None,
                     figures / "virtual_unbounded.png")
    if wall:
        plot_cap_history("wall clock, SmolLM2, bounded", results["wall"], None,
                         figures / "wall.png")
    if "wall_reference" in results:
        plot_cap_history("wall clock, SmolLM2, bounded, reference engine path",
                         results["wall_reference"], None, figures / "wall_reference.png")
    results["elapsed_s"] = time.time() - started
    Path(out_json).write_text(json.dumps(results, indent=2, default=str))
    Path(out_md).write_text(render(results, figures.name, smoke))
    return results


TABLE_HEAD = ("| run | swept N* | cap mean in 2nd half (min..max) | time to 90 % of N* | misses "
              "in 2nd half | stalled frames | goodput | admitted / refused |")
TABLE_RULE = "|---|---|---|---|---|---|---|---|"


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(r: dict, figures: str, smoke: bool) -> str:
    v, cost = r["virtual"], r["cost_model"]
    b, u = v["bounded"], v["unbounded"]
    lines = [
        "# Admission: AIMD against the swept N*", "",
        f"Generated by `metronome bench admission{' --smoke' if smoke else ''}` in "
        f"{r['elapsed_s']:.0f} s. Written by the command; do not edit by hand.", "",
        "## Virtual clock", "",
        "Engine steps are real steps of our engine (tiny random Llama); step time comes from "
        f"the packaged step cost model ({r['cost_model_source']}): "
        f"`step_s = {cost['fixed_s']:.4f} + {cost['per_token_s']:.5f} x tokens + "
        f"{cost['per_context_token_s']:.2e} x context tokens`. Sessions: 1 s frames, 12 input "
        "+ 4 output tokens, deadline 1 s, ~30 s long (jitter 30 %), arriving every 0.25 s "
        f"(faster than capacity) for {v['duration_s']:.0f} s. Target: p95 latency <= 0.8 x "
        "deadline; control interval 2 s.", "",
        TABLE_HEAD, TABLE_RULE,
        _row("bounded sinks_window 4+128", b),
        _row(f"unbounded, pool {v['unbounded_pool_tokens']} tokens", u),
        "", "Offline sweep (fixed N, no admission; steady-state p95 of latency / deadline):", "",
        "| N | p95 latency / deadline | miss rate |", "|---|---|---|",
    ]
    lines += [f"| {s['sessions']} | {s['p95_fraction']:.3f} | {s['miss_rate']:.3f} |"
              for s in v["sweep"]]
    lines += ["", f"![bounded]({figures}/virtual_bounded.png)", "",
              f"![unbounded]({figures}/virtual_unbounded.png)", ""]
    if u.get("saturated_at_s"):
        before = [h for h in u["history"] if h["at_s"] < u["saturated_at_s"]]
        signals = sum(h["misses"] + h["stalled"] for h in before)
        lines.append(
            f"Unbounded: the pool saturated at t = {u['saturated_at_s']:.1f} s with the cap at "
            f"{before[-1]['cap'] if before else '-'}, after {signals} deadline-miss or stall "
            "signals; afterwards admitted sessions stalled (they are never evicted).")
    if "wall" in r:
        lines += ["", "## Wall clock, SmolLM2 (dtype auto; bounded 4+128, arrivals every 0.5 s)",
                  "", TABLE_HEAD, TABLE_RULE, _row("wall clock, fast path", r["wall"])]
        if "wall_reference" in r:
            lines.append(_row("wall clock, reference path (dense attention, F.linear)",
                              r["wall_reference"]))
        lines += ["", f"![wall]({figures}/wall.png)", ""]
        if "wall_reference" in r:
            lines += [f"![wall, reference path]({figures}/wall_reference.png)", ""]
    return "\n".join(lines) + "\n"


def _row(name: str, s: dict) -> str:
    return (f"| {name} | {s['n_star'] or '-'} | {_f(s['steady_cap_mean'], '.1f')} "
            f"({s['steady_cap_min']}..{s['steady_cap_max']}) | {_f(s['convergence_s'], '.0f')} s "
            f"| {_f(s['miss_rate_after_convergence'], '.2%')} | {s['stalled_frames']} "
            f"| {s['goodput']:.1%} | {s['counts'].get('admitted', 0)} / "
            f"{s['counts'].get('refused:at_capacity', 0)} |")
