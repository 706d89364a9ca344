"""`metronome bench vllm`: the streaming workload (the same frame arrivals for every arm,
each arm in a fresh process, `bench.workload`): vLLM's scheduler alone in FIFO order
(`stock`; `sliding_window`: its own window of S + W), the beat on vLLM (`unbounded`;
`bounded`: the plugin) and on the native engine (`native`). Derived number: the first arm's
goodput at the most sessions. Needs vLLM (`make vllm-install`; run from .venv-vllm).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from metronome.bench import systems as sy
from metronome.bench.engine.facts import BUNDLED_MODEL, engine_path
from metronome.bench.presets import Knobs, knob
from metronome.bench.workload import in_fresh_process, run_workload, summary
from metronome.engine.engine import Engine, EngineConfig
from metronome.kv.residency import ResidencyPolicy
from metronome.model.weights import load_tokenizer
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived
from metronome.runtime.cores import reserve_for_engine_thread
from metronome.runtime.profile import SessionProfile
from metronome.sim.local import text_source
from metronome.sim.workload import Workload

NAME = "vllm"
STOCK, SLIDING, PLUGIN = "vllm", "vllm_sliding_window", "vllm_metronome"
ARMS = ("stock", "sliding_window", "unbounded", "bounded", "native")


@dataclass(frozen=True)
class Config(Knobs):
    parts: tuple[str, ...] = knob(("stream",), "stream (the step grid went: `git show c387acb:"
                                  "src/metronome/bench/vllm/decode.py`)")
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

    def __post_init__(self) -> None:
        for name, given, known in (("parts", self.parts, ("stream",)),
                                   ("stream arms", self.stream_arms, ARMS)):
            if set(given) - set(known):
                raise ValueError(f"unknown {name} {sorted(set(given) - set(known))}; known: "
                                 f"{', '.join(known)}")

    SMOKE = dict(window_tokens=64, stream_sessions=(4,), stream_duration_s=12.0,
                 stream_pool_tokens=1024)


def stream_arm(cfg: Config, sessions: int, arm: str) -> dict:
    """One arm of the streaming workload (in the fresh process `run` starts for it)."""
    bound = ResidencyPolicy.sinks_window(cfg.sink_tokens, cfg.window_tokens)
    if arm == "native":
        reserve_for_engine_thread()  # as `metronome serve` does, before the model loads
        engine = Engine(sy.load_model(), EngineConfig(pool_tokens=cfg.stream_pool_tokens))
    else:
        kind = {"stock": STOCK, "unbounded": STOCK, "sliding_window": SLIDING}.get(arm, PLUGIN)
        engine = sy.vllm_engine(kind, bound, cfg.stream_pool_tokens, 8192, sessions,
                                cfg.block_size)
    engine.warm_up()
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
    return {"sessions": sessions, "arm": arm} | summary(run)


def run(ctx: RunContext, cfg: Config) -> dict:
    import vllm

    ctx.record(model=BUNDLED_MODEL, dtype=sy.DTYPE, vllm=vllm.__version__, engine_path=
               f"vLLM {vllm.__version__} (CPU, in-process) vs native "
               f"{engine_path('fast', sy.load_model())}")
    stream = []
    for n in cfg.stream_sessions:
        for arm in cfg.stream_arms:
            ctx.log(f"streaming: {n} sessions, {arm}")
            stream.append(in_fresh_process(stream_arm, cfg, n, arm))
            ctx.keep("stream", stream)
    top = next(s for s in stream if s["sessions"] == max(cfg.stream_sessions))
    return REPORT.finish(ctx, {"config": asdict(cfg), "stream": stream, "derived": derived(
        f"goodput of {top['arm']} at {top['sessions']} sessions", top["goodput"])})


REPORT = Report("The streaming workload: Metronome against vLLM", spec=".3f", tables=(
    Table("Arms (frames due: a deadline before the arm stopped)", "stream"),))
report = REPORT.markdown
