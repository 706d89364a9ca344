"""`metronome bench admission`: the AIMD controller against the offline N* sweep.

1. Virtual clock (deterministic): engine steps are real steps of our engine on a tiny random
   Llama; step *time* comes from the packaged cost model (calibrated with `metronome bench
   engine`), so the latency curve is the calibrated model's. Bounded: offline sweep for N*
   (largest N with steady p95 latency <= target x deadline), then AIMD with sessions
   arriving faster than capacity. Unbounded with a pool that fills: the same controller
   over-admits while latency is flat, then sessions stall.
2. Wall clock on the bundled SmolLM2 (dtype auto: the one resolved is recorded): the
   server's controller (`make_limit("aimd")`, from its default `--admission-cap`) with
   arrivals faster than capacity, optionally again on the engine's reference path. Each run
   is a spawned process that reserves the cores for its engine thread before the model
   loads, as `metronome serve` and `run` do (`runtime.cores`): this process has run torch on
   its main thread for the virtual clock, which would slow every engine step ~2x.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from metronome.admission.controller import AdmissionController
from metronome.admission.limits import make_limit
from metronome.results.context import RunContext
from metronome.results.plots import plot_cap_history
from metronome.results.provenance import describe
from metronome.results.tables import fmt, md_table
from metronome.sim.admission import log, summarize, virtual_runs, workload_sentence
from metronome.sim.cost_model import PACKAGED_STEP_COST, StepCostModel
from metronome.workload_defaults import (
    BLOCK_SIZE_TOKENS,
    EXPERIMENT_POLICY_SPEC,
    FRAME_PERIOD_S,
    INPUT_TOKENS_PER_FRAME,
    OUTPUT_TOKENS_PER_FRAME,
    POOL_TOKENS,
)

NAME = "admission"
WALL_SESSION_S = 30.0
WALL_JITTER = 0.3


@dataclass(frozen=True)
class Config:
    duration_s: float = field(default=240.0, metadata={
        "help": "virtual clock: length of each AIMD run"})
    sweep_max_sessions: int = field(default=256, metadata={
        "help": "virtual clock: largest N the offline N* sweep may try"})
    wall: bool = field(default=True, metadata={
        "help": "also run the wall-clock SmolLM2 experiment"})
    wall_duration_s: float = field(default=150.0, metadata={
        "help": "wall clock: length of the AIMD run"})
    wall_arrival_every_s: float = field(default=0.25, metadata={
        "help": "wall clock: a session arrives this often (faster than capacity; at 0.5 s, "
                "~60 sessions at once, the cap never bound once the engine thread owned the "
                "cores: 0 misses, p95 <= 0.27 of the deadline with 74 sessions)"})
    compare_reference: bool = field(default=False, metadata={
        "help": "run the wall-clock experiment again on the engine's reference path "
                "(before/after)"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(duration_s=60.0, sweep_max_sessions=64, wall_duration_s=40.0)


def wall_workload(cfg: Config) -> dict:
    return {"policy": EXPERIMENT_POLICY_SPEC, "frame_period_s": FRAME_PERIOD_S,
            "input_tokens_per_frame": INPUT_TOKENS_PER_FRAME,
            "output_tokens_per_frame": OUTPUT_TOKENS_PER_FRAME, "session_s": WALL_SESSION_S,
            "jitter": WALL_JITTER, "arrival_every_s": cfg.wall_arrival_every_s,
            "duration_s": cfg.wall_duration_s, "pool_tokens": POOL_TOKENS,
            "block_size": BLOCK_SIZE_TOKENS}


def _wall_run_isolated(w: dict, engine_path: str) -> tuple[dict, dict]:
    """`_wall_run` in a fresh (spawned) process; returns its summary and the facts to record
    (model, dtype)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_wall_process, w, engine_path).result()


def _wall_process(w: dict, engine_path: str) -> tuple[dict, dict]:
    from metronome.runtime.cores import reserve_for_engine_thread

    reserve_for_engine_thread()  # before the model loads: runtime.cores says why
    return asyncio.run(_wall_run(w, engine_path))


async def _wall_run(w: dict, engine_path: str) -> tuple[dict, dict]:
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
    facts = {"model": model.config.name, "dtype": str(model.dtype).removeprefix("torch.")}
    engine = Engine(model, for_engine_path(model, EngineConfig(
        block_size=w["block_size"], pool_tokens=w["pool_tokens"]), engine_path))
    engine.warm_up()
    recorder = RunRecorder()
    controller = AdmissionController(  # as the server builds it (serve.state)
        make_limit("aimd"), lambda: len(driver.beat.sessions),
        self_paced_tokens=engine.config.max_chunk_tokens, frame_period_s=w["frame_period_s"])
    driver = WallDriver(engine, Listeners.of(recorder, controller))
    results = recorder.results
    profile = SessionProfile(frame_period_s=w["frame_period_s"],
                             max_output_tokens_per_frame=w["output_tokens_per_frame"],
                             policy=ResidencyPolicy.parse(w["policy"]))
    duration_s = w["duration_s"]
    workload = Workload(int(duration_s / w["arrival_every_s"]), w["session_s"],
                        arrival_spread_s=duration_s, duration_jitter=w["jitter"])
    source = text_source(load_tokenizer(), model.config.vocab_size, w["input_tokens_per_frame"])
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
    return summarize(Run, None, duration_s / 2), facts


def run(ctx: RunContext, cfg: Config) -> dict:
    cost, calibration = StepCostModel.load(PACKAGED_STEP_COST)
    v = virtual_runs(cost, cfg.duration_s, cfg.sweep_max_sessions)
    result = {"cost_model": vars(cost), "cost_model_source": calibration.describe(),
              "virtual": v}
    ctx.keep("virtual", v)
    policy = v["workload"]["bounded_policy"]
    plot_cap_history(f"virtual clock, bounded ({policy})", v["bounded"], v["bounded"]["n_star"],
                     ctx.plot_path("admission_virtual_bounded.png"))
    plot_cap_history("virtual clock, unbounded KV, pool fills", v["unbounded"], None,
                     ctx.plot_path("admission_virtual_unbounded.png"))
    if not cfg.wall:
        return result
    w = wall_workload(cfg)
    result["wall_workload"] = w
    paths = ("fast", "reference") if cfg.compare_reference else ("fast",)
    ctx.record(engine_path=", ".join(paths))
    for path in paths:
        log(f"wall clock: SmolLM2, AIMD, arrivals faster than capacity ({path} path)")
        key = "wall" if path == "fast" else "wall_reference"
        result[key], facts = _wall_run_isolated(w, path)
        ctx.record(**facts)
        ctx.keep(key, result[key])
        plot_cap_history(f"wall clock, {ctx.facts['model']}, {w['policy']}, {path} engine "
                         "path", result[key], None,
                         ctx.plot_path(f"admission_{key}.png"))
    return result


HEADERS = ("run", "swept N*", "cap mean in 2nd half (min..max)", "time to 90 % of N*",
           "misses in 2nd half", "stalled frames", "goodput", "admitted / refused")


def report(r: dict) -> str:
    v, cost = r["virtual"], r["cost_model"]
    b, u, vw = v["bounded"], v["unbounded"], v["workload"]
    plots = iter(r["plots"])
    lines = [
        "# Admission: AIMD against the swept N*", "",
        describe(r["provenance"]), "",
        f"Generated by `{r['command']}` in {r['elapsed_s']:.0f} s. Written by the command; "
        "do not edit by hand.", "",
        "## Virtual clock", "",
        "Engine steps are real steps of our engine (tiny random Llama); step time comes from "
        f"the packaged step cost model ({r['cost_model_source']}): "
        f"`step_s = {cost['fixed_s']:.4f} + {cost['per_token_s']:.5f} x tokens + "
        f"{cost['per_context_token_s']:.2e} x context tokens`. "
        f"{workload_sentence(vw, v['duration_s'])}", "",
        md_table(HEADERS, [_row(f"bounded {vw['bounded_policy']}", b),
                           _row(f"unbounded, pool {v['unbounded_pool_tokens']} tokens", u)]),
        "", "Offline sweep (fixed N, no admission; steady-state p95 of latency / deadline):", "",
        md_table(("N", "p95 latency / deadline", "miss rate"),
                 [(s["sessions"], fmt(s["p95_fraction"], ".3f"), fmt(s["miss_rate"], ".3f"))
                  for s in v["sweep"]]),
        "", f"![bounded]({next(plots)})", "", f"![unbounded]({next(plots)})", "",
    ]
    if u.get("saturated_at_s"):
        before = [h for h in u["history"] if h["at_s"] < u["saturated_at_s"]]
        signals = sum(h["misses"] + h["stalled"] for h in before)
        lines.append(
            f"Unbounded: the pool saturated at t = {u['saturated_at_s']:.1f} s with the cap at "
            f"{before[-1]['cap'] if before else '-'}, after {signals} deadline-miss or stall "
            "signals; afterwards admitted sessions stalled (they are never evicted).")
    if "wall" in r:
        w, prov = r["wall_workload"], r["provenance"]
        rows = [_row("wall clock, fast path", r["wall"])]
        if "wall_reference" in r:
            rows.append(_row("wall clock, reference path (dense attention, F.linear)",
                             r["wall_reference"]))
        lines += ["", f"## Wall clock, {prov.get('model')} ({prov.get('dtype')}; "
                  f"{w['policy']}, arrivals every {w['arrival_every_s']:g} s)", "",
                  f"Sessions: {w['frame_period_s']:g} s frames of "
                  f"{w['input_tokens_per_frame']} Hamlet tokens + "
                  f"{w['output_tokens_per_frame']} output tokens, ~{w['session_s']:.0f} s "
                  f"long (jitter {w['jitter']:.0%}), for {w['duration_s']:.0f} s; pool "
                  f"{w['pool_tokens']} tokens.", "", md_table(HEADERS, rows), ""]
        lines += [f"![{name}]({name})\n" for name in plots]
    return "\n".join(lines) + "\n"


def _row(name: str, s: dict) -> tuple:
    return (name, s["n_star"] or "-",
            f"{fmt(s['steady_cap_mean'], '.1f')} ({s['steady_cap_min']}..{s['steady_cap_max']})",
            f"{fmt(s['convergence_s'], '.0f')} s", fmt(s["miss_rate_after_convergence"], ".2%"),
            s["stalled_frames"], f"{s['goodput']:.1%}",
            f"{s['counts'].get('admitted', 0)} / {s['counts'].get('refused:at_capacity', 0)}")
