"""`metronome run`: a local in-process workload on the real engine, with a live display.

N sessions arrive over a ramp and stream frames (Hamlet text, or audio through the front
end) on their period; the beat answers every frame. Writes `frames.csv` (one row per frame)
and `summary.json`. Runs on the wall clock (real time, engine thread) or the virtual clock
(deterministic, step time from a cost model calibrated on this machine's engine).
"""

from __future__ import annotations

import asyncio
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.live import Live
from rich.table import Table

from metronome.engine.engine import ENGINE_PATHS, Engine, EngineConfig, for_engine_path
from metronome.kv.residency import ResidencyPolicy
from metronome.model.dtypes import AUTO_DTYPE, resolve_dtype
from metronome.results.provenance import provenance
from metronome.results.tables import fmt
from metronome.runtime.driver import OverheadMeter
from metronome.runtime.observer import RuntimeObserver
from metronome.runtime.ports import Listeners
from metronome.runtime.profile import SessionMode, SessionProfile
from metronome.runtime.wall import WallDriver
from metronome.sim.cost_model import StepCostModel, calibrate
from metronome.sim.recorder import RunRecorder
from metronome.sim.virtual import VirtualDriver
from metronome.sim.workload import FrameSource, Workload, schedule
from metronome.workload_defaults import (
    BLOCK_SIZE_TOKENS,
    DEADLINE_FRACTION,
    FRAME_PERIOD_S,
    INPUT_TOKENS_PER_FRAME,
    OUTPUT_TOKENS_PER_FRAME,
    POLICY_SPEC,
    POOL_TOKENS,
)


@dataclass(frozen=True)
class RunConfig:
    sessions: int = 4
    duration_s: float = 20.0
    ramp_s: float = 2.0
    duration_jitter: float = 0.0
    frame_period_s: float = FRAME_PERIOD_S
    deadline_fraction: float = DEADLINE_FRACTION
    tokens_per_frame: int = INPUT_TOKENS_PER_FRAME  # text; audio gets frame_period x token rate
    output_tokens: int = OUTPUT_TOKENS_PER_FRAME
    mode: str = SessionMode.DUPLEX.value
    policy: str = POLICY_SPEC
    pool_tokens: int = POOL_TOKENS
    block_size: int | None = None  # None: BLOCK_SIZE_TOKENS (native), 32 (vLLM's CPU attention)
    clock: str = "wall"
    input: str = "text"  # text | audio
    model: str = "bundled"
    engine: str = "native"  # native | vllm
    vllm_mode: str = "default"  # --engine vllm: vLLM's default (compiled) or eager
    engine_path: str = "fast"  # native engine: fast | reference (dense attention, F.linear)
    dtype: str = AUTO_DTYPE
    seed: int = 0
    out: str = "out/run"
    cost_model: dict = field(default_factory=dict)  # virtual clock: fixed constants (else fit)

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "virtual"):
            raise ValueError(f"clock must be wall or virtual, got {self.clock!r}")
        if self.input not in ("text", "audio"):
            raise ValueError(f"input must be text or audio, got {self.input!r}")
        resolve_dtype(self.dtype)  # raises for an unknown name
        if self.engine not in ("native", "vllm"):
            raise ValueError(f"engine must be native or vllm, got {self.engine!r}")
        from metronome.vllm.engine import VLLM_MODES

        if self.vllm_mode not in VLLM_MODES:
            raise ValueError(f"vllm_mode must be one of {', '.join(VLLM_MODES)}, got "
                             f"{self.vllm_mode!r}")
        if self.engine == "vllm" and (self.clock != "wall" or self.input != "text"):
            raise ValueError("--engine vllm runs on the wall clock with text input (vLLM's "
                             "streaming input takes token ids; its steps are timed, not "
                             "modelled)")
        if self.engine_path not in ENGINE_PATHS:
            raise ValueError(f"engine_path must be one of {', '.join(ENGINE_PATHS)}, got "
                             f"{self.engine_path!r}")
        if self.mode not in set(SessionMode):
            raise ValueError(f"mode must be one of {', '.join(SessionMode)}, got {self.mode!r}")

    def profile(self) -> SessionProfile:
        return SessionProfile(
            frame_period_s=self.frame_period_s, deadline_fraction=self.deadline_fraction,
            max_output_tokens_per_frame=self.output_tokens, mode=SessionMode(self.mode),
            policy=ResidencyPolicy.parse(self.policy),
        )

    def workload(self) -> Workload:
        return Workload(self.sessions, self.duration_s, self.ramp_s, self.duration_jitter,
                        seed=self.seed)


def text_source(tokenizer, vocab_size: int, tokens_per_frame: int) -> FrameSource:
    """Each session reads Hamlet from its own offset, `tokens_per_frame` per frame."""
    from metronome.corpus import TokenStream, play_text

    if tokenizer is not None:
        ids = tokenizer.encode(play_text("hamlet")).ids
    else:  # presets have no tokenizer: a fixed pseudo-random stream
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab_size, (50_000,), generator=gen).tolist()
    stream = TokenStream(ids)
    return lambda sid, index: (stream.take(sid * 7919 + index * tokens_per_frame,
                                           tokens_per_frame), None)


def audio_source(model, frame_period_s: float) -> FrameSource:
    """Synthetic voiced audio (a gliding harmonic tone with syllable-rate amplitude
    modulation) through the streaming front end, one encoder per session."""
    from metronome.audio.frontend import AudioFormat, AudioFrontEnd, StreamingAudioEncoder

    fmt = AudioFormat()
    frontend = AudioFrontEnd.for_model(model.embed_tokens, fmt)
    encoders: dict[int, StreamingAudioEncoder] = {}
    samples = round(fmt.sample_rate_hz * frame_period_s)

    def source(sid: int, index: int):
        encoder = encoders.setdefault(sid, StreamingAudioEncoder(frontend))
        t = (torch.arange(samples) + index * samples) / fmt.sample_rate_hz
        pitch_hz = 120 + 30 * torch.sin(2 * math.pi * 0.5 * t + sid)
        phase = 2 * math.pi * torch.cumsum(pitch_hz, 0) / fmt.sample_rate_hz
        voiced = sum(torch.sin(k * phase) / k for k in range(1, 6))
        envelope = 0.5 + 0.5 * torch.sin(2 * math.pi * 4 * t) ** 2
        return None, encoder.push(0.1 * voiced * envelope)

    return source


def build(config: RunConfig):
    from metronome.model.weights import load_model, load_tokenizer

    if config.engine == "vllm":
        from metronome.vllm.engine import VllmEngine

        engine = VllmEngine.for_model(config.model, config.profile().policy,
                                      config.pool_tokens, config.block_size or 32, config.dtype,
                                      mode=config.vllm_mode)
        engine.warm_up()
        return engine, text_source(load_tokenizer(config.model), engine.vocab_size,
                                   config.tokens_per_frame)
    model = load_model(config.model, resolve_dtype(config.dtype))
    engine = Engine(model, for_engine_path(model, EngineConfig(
        block_size=config.block_size or BLOCK_SIZE_TOKENS, pool_tokens=config.pool_tokens),
        config.engine_path))
    engine.warm_up()
    if config.input == "audio":
        source = audio_source(model, config.frame_period_s)
    else:
        source = text_source(load_tokenizer(config.model), model.config.vocab_size,
                             config.tokens_per_frame)
    return engine, source


def run_local(config: RunConfig, console: Console | None = None,
              recorder: RunRecorder | None = None) -> dict:
    """Run and summarize; pass a `recorder` to keep every frame result and step sample."""
    console = console or Console(stderr=True)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    engine, source = build(config)
    recorder = recorder if recorder is not None else RunRecorder()
    observer = RuntimeObserver.create(engine.config.block_size)
    started = time.perf_counter()
    if config.clock == "virtual":
        cost = _cost_model(config, engine, console)
        overhead = _run_virtual(config, engine, source, recorder, observer, cost, console)
    else:
        cost = None
        overhead = asyncio.run(_run_wall(config, engine, source, recorder, observer, console))
    dtype = str(resolve_dtype(config.dtype)).removeprefix("torch.")  # what build() loaded
    summary = recorder.summary() | {
        # the command that made it (a `metronome run`, or an experiment that ran it), where
        "command": shlex.join(["metronome", *sys.argv[1:]]), "provenance": provenance(
            dtype=dtype, clock=config.clock, engine_path=config.engine_path),
        "config": asdict(config),
        "dtype": dtype,
        "cost_model": None if cost is None else asdict(cost),
        "health": observer.health_summary(),
        "runtime_overhead": overhead.summary(),
        "elapsed_wall_s": time.perf_counter() - started,
    }
    engine.shutdown()
    recorder.write_csv(out / "frames.csv")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _cost_model(config: RunConfig, engine: Engine, console: Console) -> StepCostModel:
    if config.cost_model:
        return StepCostModel(**config.cost_model)
    with console.status("calibrating the step cost model on this engine"):
        cost, _ = calibrate(engine)
    return cost


def _run_virtual(config, engine, source, recorder, observer, cost, console) -> OverheadMeter:
    driver = VirtualDriver(engine, cost, Listeners.of(recorder, observer))
    workload = config.workload()
    schedule(workload, config.profile(), driver.beat, driver.clock, source)
    end_s = workload.end_s + 2 * config.frame_period_s
    with Live(_progress(recorder, observer, 0.0, end_s), console=console,
              refresh_per_second=4) as live:
        t = 0.0
        while t < end_s:
            t = min(end_s, t + config.frame_period_s)
            driver.run_until(t)
            live.update(_progress(recorder, observer, t, end_s))
    return driver.overhead


async def _run_wall(config, engine, source, recorder, observer, console) -> OverheadMeter:
    driver = WallDriver(engine, Listeners.of(recorder, observer))
    workload = config.workload()
    schedule(workload, config.profile(), driver.beat, driver.timer, source)
    end_s = workload.end_s + 2 * config.frame_period_s
    try:
        with Live(console=console, refresh_per_second=4) as live:
            while (elapsed_s := driver.now_s()) < end_s:
                live.update(_progress(recorder, observer, elapsed_s, end_s))
                await asyncio.sleep(0.25)
    finally:
        driver.close()
    return driver.overhead


def _progress(recorder: RunRecorder, observer, t_s: float, end_s: float) -> Table:
    s = recorder.summary()
    table = Table(title=f"metronome run  t={t_s:.1f}/{end_s:.1f} s")
    for column in ("frames", "goodput", "deadline met", "p95 ms", "stalled", "health", "pool"):
        table.add_column(column)
    table.add_row(
        str(s["frames"]), fmt(s["goodput"], ".1%"), fmt(s["deadline_met_fraction"], ".1%"),
        fmt(s["latency_ms"]["p95"], ".0f"), str(s["frames_by_status"]["stalled_kv"]),
        observer.health_line(), observer.pool_line(),
    )
    return table
