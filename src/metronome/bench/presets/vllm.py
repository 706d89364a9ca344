"""`metronome bench vllm`: Metronome on vLLM against vLLM's own sliding window, in the mode
vLLM runs in (`--vllm-mode`: its default, compiled, unless told).

Parts: `stream`, the streaming workload (the same frame arrivals for every arm, each arm
in a fresh process, `bench.workload`, `--repeats` runs of every point): vLLM's scheduler
alone in FIFO order (`stock`; `sliding_window`: its own window of S + W), the beat on vLLM
(`unbounded`; `bounded`: the plugin) and on the native engine (`native`); `--profile`
records every vLLM step (`metronome.vllm.profile`). The capacity table gives, per arm, the
most sessions at which every run kept >= 99 % of frames on time. `steps`: the plugin's
decode and 16-token chunk steps against vLLM's sliding window at N sessions x L tokens,
both engines alive in one process, their steps interleaved. Derived number: the plugin's
worst step ratio if steps ran, else the first arm's goodput at the most sessions. Needs vLLM
(`make vllm-install`; run from .venv-vllm).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass

from metronome.bench import systems as sy
from metronome.bench.engine.facts import BUNDLED_MODEL, engine_path
from metronome.bench.presets import Knobs, knob
from metronome.bench.steps import interleave, stats
from metronome.bench.workload import in_fresh_process, run_workload, summary
from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model.weights import load_tokenizer
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived
from metronome.runtime.cores import ENGINE_SWITCH_INTERVAL_S, reserve_for_engine_thread
from metronome.runtime.profile import SessionProfile
from metronome.sim.local import text_source
from metronome.sim.workload import Workload
from metronome.stream import Stream

NAME = "vllm"
STOCK, SLIDING, PLUGIN = "vllm", "vllm_sliding_window", "vllm_metronome"
ARMS = ("stock", "sliding_window", "unbounded", "bounded", "native")
BEAT_ON_VLLM = ("unbounded", "bounded")  # the arms the GIL switch interval applies to


@dataclass(frozen=True)
class Config(Knobs):
    parts: tuple[str, ...] = knob(("stream",), "stream | steps")
    sink_tokens: int = knob(4, "the bound's sinks")
    window_tokens: int = knob(512, "the bound's window")
    block_size: int = knob(32, "KV block size (vLLM's CPU attention: multiples of 32)")
    stream_arms: tuple[str, ...] = knob(ARMS, f"streaming arms, of {', '.join(ARMS)}")
    stream_sessions: tuple[int, ...] = knob((4, 8), "streaming sessions (each: every arm)")
    stream_duration_s: float = knob(200.0, "length of the streaming workload")
    stream_period_s: float = knob(1.0, "frame period, and each frame's deadline")
    stream_tokens_in: int = knob(16, "input tokens per frame")
    stream_tokens_out: int = knob(4, "output tokens per frame")
    stream_pool_tokens: int = knob(6720, "the streaming engines' KV pool in tokens")
    vllm_mode: str = knob("default", "how vLLM runs: default (vLLM's own: compiled; on CPU "
                          "vLLM turns async scheduling off) or eager (enforce_eager)")
    repeats: int = knob(1, "runs of every (sessions, arm) point, each in a fresh process")
    gil_switch_ms: tuple[float, ...] = knob(
        (ENGINE_SWITCH_INTERVAL_S * 1e3,), "the beat's vLLM arms: the GIL switch interval, "
        "each value its own runs (runtime.cores; what serve sets; Python's default is 5)")
    profile: bool = knob(False, "record every vLLM step (metronome.vllm.profile): shapes, "
                         "waiting, preemptions, time inside and outside vLLM's step")

    def __post_init__(self) -> None:
        from metronome.vllm.engine import VLLM_MODES

        if self.vllm_mode not in VLLM_MODES:
            raise ValueError(f"unknown vLLM mode {self.vllm_mode!r}; known: "
                             f"{', '.join(VLLM_MODES)}")
        if not self.gil_switch_ms or min(self.gil_switch_ms) <= 0:
            raise ValueError(f"gil_switch_ms must be > 0, got {self.gil_switch_ms}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        for name, given, known in (("parts", self.parts, ("stream", "steps")),
                                   ("stream arms", self.stream_arms, ARMS)):
            if set(given) - set(known):
                raise ValueError(f"unknown {name} {sorted(set(given) - set(known))}; known: "
                                 f"{', '.join(known)}")

    step_sessions: tuple[int, ...] = knob((8, 32, 64), "steps: sessions in one step (N)")
    step_context_tokens: int = knob(1024, "steps: tokens of context per session (L)")
    step_rounds: int = knob(3, "steps: rounds of steps per cell, the order rotating")
    steps_per_round: int = knob(6, "steps: timed steps per system and round")

    SMOKE = dict(parts=("stream", "steps"), window_tokens=64, stream_sessions=(4,),
                 stream_duration_s=12.0, stream_pool_tokens=1024, vllm_mode="eager",
                 profile=True, step_sessions=(2,), step_context_tokens=160, step_rounds=2,
                 steps_per_round=2)


def stream_arm(cfg: Config, sessions: int, arm: str, switch_ms: float | None = None) -> dict:
    """One arm of the streaming workload (in the fresh process `run` starts for it)."""
    bound = ResidencyPolicy.sinks_window(cfg.sink_tokens, cfg.window_tokens)
    # the beat's arms run as `metronome serve` does (runtime.cores): the native engine keeps
    # torch's threads for its thread; vLLM binds its own, so it gets the GIL switch only
    if arm == "native":
        reserve_for_engine_thread()
    elif arm in BEAT_ON_VLLM:
        sys.setswitchinterval((switch_ms or ENGINE_SWITCH_INTERVAL_S * 1e3) / 1e3)
    profiler = None
    if arm == "native":
        engine = Engine(sy.load_model(), EngineConfig(pool_tokens=cfg.stream_pool_tokens))
    else:
        from metronome.vllm.profile import StepProfiler

        kind = {"stock": STOCK, "unbounded": STOCK, "sliding_window": SLIDING}.get(arm, PLUGIN)
        engine = sy.vllm_engine(kind, bound, cfg.stream_pool_tokens, 8192, sessions,
                                cfg.block_size, mode=cfg.vllm_mode)
        profiler = StepProfiler(engine) if cfg.profile else None
    engine.warm_up()
    warm_s = time.perf_counter()
    vocab = engine.vocab_size if arm != "native" else engine.model.config.vocab_size
    try:
        run = run_workload(
            engine, Workload(sessions, cfg.stream_duration_s, cfg.stream_period_s),
            SessionProfile(frame_period_s=cfg.stream_period_s,
                           max_output_tokens_per_frame=cfg.stream_tokens_out,
                           policy=bound if arm in ("bounded", "native") else
                           ResidencyPolicy.unbounded()),
            text_source(load_tokenizer(), vocab, cfg.stream_tokens_in),
            clock="fifo" if arm in ("stock", "sliding_window") else "wall",
            log=lambda line: print(f"  {arm}: {line}", flush=True))
    finally:
        engine.shutdown()
    result = {"sessions": sessions, "arm": arm} | summary(run)
    if profiler is not None:
        result["profile"] = profiler.summary(skip_s=warm_s - profiler.started_s)
    return result


CHUNK_TOKENS = 16


class Chunk:
    """Every session of `sids` feeds 16 tokens of text and samples one, each step (the
    streaming workload's input step)."""

    def __init__(self, engine, sids: list[str], ids: list[int]) -> None:
        self.engine, self.sids, self.ids, self.offset = engine, sids, ids, 0

    def step(self) -> None:
        for k, sid in enumerate(self.sids):
            start = (self.offset + 997 * k) % (len(self.ids) - CHUNK_TOKENS)
            self.engine.submit(sid, self.ids[start:start + CHUNK_TOKENS], max_new_tokens=1)
        self.offset += CHUNK_TOKENS
        while self.engine.has_work:
            self.engine.step()


def step_cells(cfg: Config, log) -> list[dict]:
    """The plugin's decode and chunk steps against vLLM's sliding window (same S + W resident
    per session), both alive in this process, per N sessions of L tokens."""
    bound = ResidencyPolicy.sinks_window(cfg.sink_tokens, cfg.window_tokens)
    top, length = max(cfg.step_sessions), cfg.step_context_tokens
    step_tokens = max(256, top * (CHUNK_TOKENS + 1))  # one chunk step holds every session
    # each session: its bound, the tokens one step may put in flight, and what the cells add
    per_session = bound.sink_tokens + bound.window_tokens + step_tokens + 2 * cfg.block_size
    grown = length + 2 * (cfg.step_rounds + 1) * cfg.steps_per_round * (CHUNK_TOKENS + 2)
    pool = top * -(-per_session // cfg.block_size) * cfg.block_size
    options = dict(max_step_tokens=step_tokens, max_chunk_tokens=step_tokens,
                   mode=cfg.vllm_mode)
    engines = {}
    try:
        for arm, kind in (("sliding_window", SLIDING), ("bounded", PLUGIN)):
            log(f"steps: starting {arm} ({cfg.vllm_mode} mode), pool of {pool:,} tokens")
            engines[arm] = sy.vllm_engine(kind, bound, pool, grown + 1024, top,
                                          cfg.block_size, **options)
        ids = sy.text_ids(2 * length + 4096)
        sids = {arm: [e.open_session(Stream.of(SessionSpec(policy=bound if arm == "bounded"
                                                           else ResidencyPolicy.unbounded(),
                                                           stop_token_ids=())))
                      for _ in range(top)] for arm, e in engines.items()}
        for arm, engine in engines.items():
            log(f"steps: {arm}: {top} sessions to {length:,} tokens (untimed)")
            sy.Prefill(engine, sids[arm], length, ids).step()
        rows = []
        for n in cfg.step_sessions:
            for shape in ("decode", "chunk"):
                if shape == "decode":
                    systems = {arm: sy.Decode(e, sids[arm][:n], cfg.step_rounds
                                              * cfg.steps_per_round + 8)
                               for arm, e in engines.items()}
                else:
                    systems = {arm: Chunk(e, sids[arm][:n], ids) for arm, e in engines.items()}
                times = {arm: stats(t) for arm, t in interleave(
                    systems, cfg.step_rounds, cfg.steps_per_round).items()}
                if shape == "decode":
                    for decode in systems.values():
                        decode.finish()
                ms = {arm: times[arm]["median_ms"] for arm in engines}
                rows.append({"shape": shape, "sessions": n, "context_tokens": length,
                             "sliding_window_ms": ms["sliding_window"],
                             "plugin_ms": ms["bounded"],
                             "ratio": ms["bounded"] / ms["sliding_window"],
                             "round_medians_ms": {a: times[a]["round_medians_ms"]
                                                  for a in engines}})
                log(f"steps: N={n} {shape}: plugin {ms['bounded']:.1f} ms, sliding window "
                    f"{ms['sliding_window']:.1f} ms ({rows[-1]['ratio']:.2f}x)")
        return rows
    finally:
        for engine in engines.values():
            engine.shutdown()


def capacity(stream: list[dict], floor: float = 0.99) -> list[dict]:
    """Per arm (and GIL switch interval, where it has several): every point's runs (goodput:
    min and max over runs) and the most sessions at which every run kept >= `floor` of its
    frames on time."""
    rows = []
    for arm, switch in dict.fromkeys((r["arm"], r.get("gil_switch_ms")) for r in stream):
        mine = [r for r in stream if r["arm"] == arm and r.get("gil_switch_ms") == switch]
        points = sorted({r["sessions"] for r in mine})
        held = [n for n in points if all((r["goodput"] or 0) >= floor for r in mine
                                         if r["sessions"] == n)]
        for n in points:
            runs = [r["goodput"] or 0 for r in mine if r["sessions"] == n]
            rows.append({"arm": arm, "gil_switch_ms": switch, "sessions": n, "runs": len(runs),
                         "goodput_min": min(runs), "goodput_max": max(runs),
                         "held": n in held, "capacity": max(held, default=0)})
    return rows


def run(ctx: RunContext, cfg: Config) -> dict:
    import vllm

    ctx.record(model=BUNDLED_MODEL, dtype=sy.DTYPE, vllm=vllm.__version__,
               vllm_mode=cfg.vllm_mode, engine_path=
               f"vLLM {vllm.__version__} (CPU, in-process) vs native "
               f"{engine_path('fast', sy.load_model())}")
    result: dict = {"config": asdict(cfg)}
    if "steps" in cfg.parts:
        result["steps"] = step_cells(cfg, ctx.log)
        ctx.keep("steps", result["steps"])
    stream = []
    # the other arms do not depend on the switch interval: they run once per point and run
    arms = [(arm, switch) for arm in cfg.stream_arms for switch in (
        cfg.gil_switch_ms if arm in BEAT_ON_VLLM else (None,))]
    for repeat in range(cfg.repeats if "stream" in cfg.parts else 0):
        for n in cfg.stream_sessions:
            for arm, switch in arms:
                ctx.log(f"streaming: {n} sessions, {arm}"
                        f"{'' if switch is None else f' (GIL switch {switch:g} ms)'}, "
                        f"run {repeat + 1} of {cfg.repeats}")
                stream.append(in_fresh_process(stream_arm, cfg, n, arm, switch) | {
                    "run": repeat + 1, "gil_switch_ms": switch})
                ctx.keep("stream", stream)
    if stream:
        result |= {"stream": stream, "capacity": capacity(stream)}
    if result.get("steps"):
        worst = max(result["steps"], key=lambda r: r["ratio"])
        result["derived"] = derived(
            f"the plugin's step over vLLM's sliding window, the worst of "
            f"{len(result['steps'])} cells ({worst['shape']}, N={worst['sessions']})",
            worst["ratio"])
    elif stream:
        top = next(s for s in stream if s["sessions"] == max(cfg.stream_sessions))
        result["derived"] = derived(f"goodput of {top['arm']} at {top['sessions']} sessions",
                                    top["goodput"])
    return REPORT.finish(ctx, result)


PROFILE = (("steps/s", "profile.steps_per_s", ".1f"),
           ("step ms p50", "profile.step_ms.p50", ".1f"),
           ("step ms p95", "profile.step_ms.p95", ".1f"),
           ("tokens/step", "profile.tokens.mean", ".1f"),
           ("decode rows", "profile.decode_rows.mean", ".1f"),
           ("chunk rows", "profile.chunk_rows.mean", ".1f"),
           ("in vLLM's step", "profile.share_vllm", ".2f"),
           ("between steps", "profile.share_between", ".2f"),
           ("waiting max", "profile.waiting.max", ""),
           ("preempted", "profile.preempted", ""))
REPORT = Report("Metronome on vLLM against vLLM's sliding window", spec=".3f", tables=(
    Table("Step cells: the plugin against vLLM's sliding window (ms: median of the rounds' "
          "medians)", "steps", (("shape", "shape", ""), ("N", "sessions", ""),
                                ("L", "context_tokens", ",d"),
                                ("sliding window ms", "sliding_window_ms", ".1f"),
                                ("plugin ms", "plugin_ms", ".1f"), ("ratio", "ratio", ".2f"))),
    Table("Capacity: the most sessions every run held at >= 99 % of frames on time",
          "capacity", (("arm", "arm", ""), ("GIL switch ms", "gil_switch_ms", "g"),
                       ("sessions", "sessions", ""), ("runs", "runs", ""),
                       ("goodput, worst run", "goodput_min", ".3f"),
                       ("goodput, best run", "goodput_max", ".3f"), ("held", "held", ""),
                       ("capacity", "capacity", ""))),
    Table("Streaming runs (frames due: a deadline before the arm stopped)", "stream", (
        ("sessions", "sessions", ""), ("arm", "arm", ""), ("GIL switch ms", "gil_switch_ms", "g"),
        ("run", "run", ""),
        ("frames", "frames", ""), ("never answered", "never_answered", ""),
        ("goodput", "goodput", ".3f"), ("p50 ms", "p50_ms", ".0f"),
        ("p95 ms", "p95_ms", ".0f"), ("stalled_kv", "stalled_kv", ""), *PROFILE)),))
report = REPORT.markdown
