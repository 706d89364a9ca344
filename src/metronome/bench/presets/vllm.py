"""`metronome bench vllm`: Metronome's bound inside vLLM, beside stock vLLM, vLLM's own sliding
window and the native engine.

`steps`: at N sessions x L tokens of context, stock vLLM (full attention), vLLM's sliding
window of S + W tokens (the same resident KV), vLLM + the bound (the plugin) and the native
engine with the bound. Per L, the systems of a group (`engine_groups`) are alive together
with the largest N sessions at L, and their decode steps (every session one token) and chunk
steps (every session `chunk_tokens` of real text) are interleaved (`bench.steps`) at each N.
`stream`: the streaming workload (`stream_tokens_in` in / `stream_tokens_out` out per frame,
deadline one period, the same frame arrival times for every arm) through `bench.workload`,
each arm in a fresh process: vLLM's scheduler alone in FIFO order (`stock`,
`sliding_window`) and the beat on vLLM (`unbounded`, `bounded`) or on the native engine
(`native`, its defaults). Derived number: the plugin's decode step over the sliding
window's (geometric mean over the cells), or, with `--parts stream` alone, the first arm's
goodput at the most sessions. Needs vLLM (`make vllm-install`; run from .venv-vllm).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from metronome.bench.presets import knob
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "vllm"
NATIVE, STOCK, SLIDING, PLUGIN = "native", "vllm", "vllm_sliding_window", "vllm_metronome"
ARMS = ("stock", "sliding_window", "unbounded", "bounded", "native")


@dataclass(frozen=True)
class Config:
    parts: tuple[str, ...] = knob(("steps", "stream"), "steps (the step grid), stream")
    sessions: tuple[int, ...] = knob((8, 32, 64), "sessions in one step (N)")
    lengths: tuple[int, ...] = knob((1024, 4096), "tokens of context per session (L)")
    sink_tokens: int = knob(4, "the bound's sinks")
    window_tokens: int = knob(512, "the bound's window")
    max_prefill_tokens: int = knob(65536, "cells whose N x L exceeds this are skipped")
    decode_steps: int = knob(6, "timed decode steps per system, round and N")
    chunk_tokens: int = knob(16, "tokens each session feeds in a chunk step")
    chunk_steps: int = knob(4, "timed chunk steps per system, round and N")
    repeats: int = knob(3, "rounds, the systems' order rotating")
    max_step_tokens: int = knob(1024, "every system's tokens per step")
    block_size: int = knob(32, "KV block size (vLLM's CPU attention: multiples of 32)")
    engine_groups: tuple[str, ...] = knob((STOCK, f"{NATIVE}+{SLIDING}+{PLUGIN}"),
                                          "systems alive together ('+'-joined), in turn")
    stream_arms: tuple[str, ...] = knob(ARMS, f"streaming arms, of {', '.join(ARMS)}")
    stream_sessions: tuple[int, ...] = knob((4, 8), "streaming sessions (each: every arm)")
    stream_duration_s: float = knob(200.0, "length of the streaming workload")
    stream_period_s: float = knob(1.0, "frame period, and each frame's deadline")
    stream_tokens_in: int = knob(16, "input tokens per frame")
    stream_tokens_out: int = knob(4, "output tokens per frame")
    stream_pool_tokens: int = knob(6720, "the streaming engines' KV pool in tokens")
    stream_phases: str = knob("random", "where frames fall in the period, every arm alike: "
                              "random (seeded) or even")

    def __post_init__(self) -> None:
        groups = {s for g in self.engine_groups for s in g.split("+")}
        for name, given, known in (("parts", self.parts, ("steps", "stream")),
                                   ("stream arms", self.stream_arms, ARMS),
                                   ("systems", groups, (NATIVE, STOCK, SLIDING, PLUGIN)),
                                   ("stream phases", (self.stream_phases,), ("random", "even"))):
            if set(given) - set(known):
                raise ValueError(f"unknown {name} {sorted(set(given) - set(known))}; known: "
                                 f"{', '.join(known)}")

    @classmethod
    def smoke(cls) -> Config:
        return cls(sessions=(2, 4), lengths=(256,), window_tokens=64, decode_steps=3,
                   chunk_steps=2, repeats=2, max_step_tokens=256, stream_sessions=(4,),
                   stream_duration_s=12.0, stream_pool_tokens=1024)

    @property
    def bound(self):
        from metronome.kv.residency import ResidencyPolicy

        return ResidencyPolicy.sinks_window(self.sink_tokens, self.window_tokens)


def _cells(cfg: Config, model, group: list[str], length: int, log) -> list[dict]:
    """Every system of `group` alive at once at `length`; decode and chunk steps per N."""
    import torch

    from metronome.bench import systems as sy
    from metronome.bench.steps import interleave, stats
    from metronome.kv.residency import ResidencyPolicy

    sessions = [n for n in cfg.sessions if n * length <= cfg.max_prefill_tokens]
    top, added = max(sessions), (cfg.decode_steps + cfg.chunk_steps * (cfg.chunk_tokens + 1)
                                 ) * cfg.repeats * len(sessions) + 64
    ids, engines, sids, threads = sy.text_ids(2 * length + cfg.chunk_tokens), {}, {}, {}
    budget = {"max_step_tokens": cfg.max_step_tokens,
              "max_chunk_tokens": min(512, cfg.max_step_tokens)}
    try:
        for kind in group:
            bounded = kind in (NATIVE, PLUGIN)
            policy = cfg.bound if bounded else ResidencyPolicy.unbounded()
            per_session = (length + added if kind == STOCK else cfg.sink_tokens
                           + cfg.window_tokens + (cfg.max_step_tokens + 64 if kind != NATIVE
                                                  else cfg.chunk_tokens + 3 * cfg.block_size))
            pool = -(-top * per_session // cfg.block_size) * cfg.block_size
            if kind == NATIVE:
                sy.set_threads(os.cpu_count())  # vLLM, started first, may have left one
                engines[kind] = sy.native(model, pool, cfg.block_size, **budget)
                sids[kind] = sy.open_sessions(engines[kind], top, policy, length)
            else:
                engines[kind] = sy.vllm_engine(kind, cfg.bound, pool, length + added + 64,
                                               max(cfg.sessions), cfg.block_size, **budget)
                sids[kind] = sy.open_sessions(engines[kind], top, policy)
                prefill = sy.Prefill(engines[kind], policy, sids[kind], length, ids, 1)
                prefill.prepare()
                prefill.step()
            threads[kind] = os.cpu_count() if kind == NATIVE else torch.get_num_threads()
            log(f"  {kind} L={length:,}: pool {pool:,} tokens, {top} sessions at L")
        cells = []
        for n in sessions:
            steps = cfg.repeats * cfg.decode_steps + 1
            decode = {k: sy.Decode(e, sids[k][:n], steps, threads[k]) for k, e in engines.items()}
            chunk = {k: sy.Chunk(e, sids[k][:n], ids[-cfg.chunk_tokens:], threads[k])
                     for k, e in engines.items()}
            for step, systems, per_round in (("decode", decode, cfg.decode_steps),
                                             ("chunk", chunk, cfg.chunk_steps)):
                for kind, t in interleave(systems, cfg.repeats, per_round).items():
                    s, rows = stats(t), n * (1 if step == "decode" else cfg.chunk_tokens)
                    cells.append({"engine": kind, "step": step, "sessions": n,
                                  "context_tokens": length, "step_ms_median": s["median_ms"],
                                  "step_ms_min": s["min_ms"], "tokens_per_s": rows
                                  / s["median_ms"] * 1e3, "curve": f"{kind} L={length}",
                                  "irregular_steps": getattr(systems[kind], "partial", 0)
                                  + getattr(systems[kind], "extra_steps", 0)})
                for system in decode.values() if step == "decode" else ():
                    system.finish()
            log(f"  L={length:,} N={n}: " + ", ".join(
                f"{c['engine']} {c['step']} {c['step_ms_median']:.1f} ms" for c in cells[-2 * len(
                    engines):]))
        return cells
    finally:
        for engine in engines.values():
            engine.shutdown()


def stream_arm(cfg: Config, sessions: int, arm: str) -> dict:
    """One arm of the streaming workload (in the fresh process `run` starts for it)."""
    from metronome.bench import systems as sy
    from metronome.bench.workload import run_workload, summary
    from metronome.engine.engine import Engine, EngineConfig
    from metronome.kv.residency import ResidencyPolicy
    from metronome.model.weights import load_tokenizer
    from metronome.runtime.cores import reserve_for_engine_thread
    from metronome.runtime.profile import SessionProfile
    from metronome.sim.local import text_source
    from metronome.sim.workload import Workload

    policy = cfg.bound if arm in ("bounded", "native") else ResidencyPolicy.unbounded()
    if arm == "native":
        reserve_for_engine_thread()  # as `metronome serve` does, before the model loads
        engine = Engine(sy.load_model(), EngineConfig(pool_tokens=cfg.stream_pool_tokens))
        vocab = engine.model.config.vocab_size
    else:
        kind = {"stock": STOCK, "unbounded": STOCK, "sliding_window": SLIDING}.get(arm, PLUGIN)
        engine = sy.vllm_engine(kind, cfg.bound, cfg.stream_pool_tokens, 8192, sessions,
                                cfg.block_size)
        vocab = engine.vocab_size
    engine.warm_up()
    profile = SessionProfile(frame_period_s=cfg.stream_period_s, policy=policy,
                             max_output_tokens_per_frame=cfg.stream_tokens_out)
    try:
        run = run_workload(
            engine, Workload(sessions, cfg.stream_duration_s, cfg.stream_period_s,
                             even_arrivals=cfg.stream_phases == "even"), profile,
            text_source(load_tokenizer(), vocab, cfg.stream_tokens_in),
            clock="fifo" if arm in ("stock", "sliding_window") else "wall",
            log=lambda line: print(f"  {arm}: {line}", flush=True))
    finally:
        engine.shutdown()
    return {"sessions": sessions, "arm": arm} | summary(run)


def run(ctx: RunContext, cfg: Config) -> dict:
    import vllm

    from metronome.bench import systems as sy
    from metronome.bench.engine.facts import BUNDLED_MODEL, engine_path
    from metronome.bench.steps import geomean
    from metronome.bench.workload import in_fresh_process

    model = sy.load_model()
    ctx.record(model=BUNDLED_MODEL, dtype=sy.DTYPE, vllm=vllm.__version__, engine_path=
               f"vLLM {vllm.__version__} (CPU, in-process) vs native {engine_path('fast', model)}")
    cells, stream = [], []
    for length in cfg.lengths if "steps" in cfg.parts else ():
        for group in cfg.engine_groups:
            if any(n * length <= cfg.max_prefill_tokens for n in cfg.sessions):
                cells += _cells(cfg, model, group.split("+"), length, ctx.log)
                ctx.keep("cells", cells)
    for n in cfg.stream_sessions if "stream" in cfg.parts else ():
        for arm in cfg.stream_arms:
            ctx.log(f"streaming: {n} sessions, {arm}")
            stream.append(in_fresh_process(stream_arm, cfg, n, arm))
            ctx.keep("stream", stream)
    by = {(c["engine"], c["sessions"], c["context_tokens"]): c["step_ms_median"]
          for c in cells if c["step"] == "decode"}
    ratios = [by[(PLUGIN, n, length)] / by[(SLIDING, n, length)] for (e, n, length) in by
              if e == PLUGIN and (SLIDING, n, length) in by]
    top = [s for s in stream if s["sessions"] == max(cfg.stream_sessions)][:1]
    return REPORT.finish(ctx, {"config": asdict(cfg), "cells": cells, "stream": stream,
                               "derived": derived(
        "vLLM + Metronome over vLLM's sliding window, decode step (geometric mean over "
        f"{len(ratios)} cells)", geomean(ratios)) if ratios else derived(
        f"goodput of {top[0]['arm']} at {top[0]['sessions']} sessions" if top else "goodput",
        top[0]["goodput"] if top else None)})


CELL = (("system", "engine", ""), ("N", "sessions", ""), ("L", "context_tokens", ""),
        ("median ms", "step_ms_median", ".1f"), ("min ms", "step_ms_min", ".1f"),
        ("input tokens/s", "tokens_per_s", ".0f"),
        ("steps not every session's, or split", "irregular_steps", ""))
REPORT = Report("Metronome on vLLM: the bound's step cost and the streaming workload",
                spec=".3f", tables=(
    Table("Decode steps (every session one token)", "cells", CELL, (("step", "decode"),)),
    Table("Chunk steps (every session a chunk of text)", "cells", CELL, (("step", "chunk"),)),
    Table("The streaming workload (frames due: a deadline before the arm stopped)", "stream", (
        ("N", "sessions", ""), ("arm", "arm", ""), ("frames due", "frames", ""),
        ("never answered", "never_answered", ""), ("goodput", "goodput", ".3f"),
        ("p50 ms", "p50_ms", ".0f"), ("p95 ms", "p95_ms", ".0f"),
        ("stalled_kv", "stalled_kv", ""), ("first stall s", "first_stall_s", ".1f"),
        ("first unanswered s", "first_unanswered_s", ".1f"),
        ("health critical from s", "critical_from_s", ".1f")))),
    plots=(Plot("{stem}.png", "cells", x="sessions", ys=("step_ms_median",), series="curve",
                where=(("step", "decode"),)),))
report = REPORT.markdown
