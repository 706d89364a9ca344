"""`metronome load`: N Realtime sessions against a server, with a live display.

Sessions start on a ramp (evenly over `ramp_s`) or as a Poisson process (mean rate
N / ramp_s), each streaming `duration_s` of speech at real-time pace. Writes `frames.csv`
(one row per frame result) and `summary.json`: client-observed and server-side latency,
goodput, tokens, gaps between results, refusals and errors.
"""

from __future__ import annotations

import asyncio
import csv
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from metronome.load.client import ClientSettings, FrameRecord, SessionClient, SessionOutcome
from metronome.load.speech import SPEECH_DIR, speech_stream
from metronome.stats import percentile

STUTTER_FACTOR = 1.5  # a gap between results longer than 1.5 frame periods is a stutter


@dataclass(frozen=True)
class LoadConfig:
    url: str = "ws://127.0.0.1:8000/v1/realtime"
    sessions: int = 4
    ramp_s: float = 2.0
    arrival: str = "ramp"  # ramp | poisson
    duration_s: float = 30.0  # speech streamed by each session
    chunk_ms: float = 100.0  # audio per append
    sample_rate_hz: int = 24000
    mode: str = "duplex"
    audio_dir: str | None = None  # folder of speech WAVs; None: the packaged fixtures
    api_key: str | None = field(default=None, repr=False)
    out: str = "out/load"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.duration_s <= 0 or self.chunk_ms <= 0:
            raise ValueError(f"need sessions >= 1, duration_s > 0 and chunk_ms > 0, got "
                             f"{self.sessions}, {self.duration_s}, {self.chunk_ms}")
        if self.arrival not in ("ramp", "poisson"):
            raise ValueError(f"arrival must be ramp or poisson, got {self.arrival!r}")
        if self.audio_dir is not None and not Path(self.audio_dir).is_dir():
            raise ValueError(f"audio_dir {self.audio_dir!r} is not a folder")

    def start_times_s(self) -> list[float]:
        if self.arrival == "ramp":
            return [i * self.ramp_s / self.sessions for i in range(self.sessions)]
        rng, at_s, times = random.Random(self.seed), 0.0, []
        for _ in range(self.sessions):
            times.append(at_s)
            at_s += rng.expovariate(self.sessions / self.ramp_s) if self.ramp_s else 0.0
        return times


@dataclass
class LoadRecorder:
    frames: list[FrameRecord] = field(default_factory=list)
    outcomes: list[SessionOutcome] = field(default_factory=list)
    started: int = 0

    def summary(self, period_s: float | None = None) -> dict:
        frames, outcomes = self.frames, self.outcomes
        client = [f.client_latency_ms for f in frames if f.client_latency_ms is not None]
        server = [f.server_latency_ms for f in frames]
        diff = [f.client_latency_ms - f.server_latency_ms for f in frames
                if f.client_latency_ms is not None]
        gaps = [f.gap_ms for f in frames if f.gap_ms is not None]
        on_time = [f.good and f.client_on_time for f in frames if f.client_on_time is not None]
        errors = sum((o.errors for o in outcomes), Counter())
        return {
            "sessions": {"started": self.started, "finished": len(outcomes)}
            | dict(Counter(o.outcome for o in outcomes)),
            "retry_after_s": sorted({o.retry_after_s for o in outcomes if o.retry_after_s}),
            "frames": len(frames),
            "frames_by_status": dict(Counter(f.status for f in frames)),
            "goodput_server": _share([f.good for f in frames]),
            "goodput_client": _share(on_time),
            "latency_ms": {"client": _stats(client), "server": _stats(server),
                           "client_minus_server": _stats(diff)},
            "tokens": sum(f.num_tokens for f in frames),
            "tokens_per_frame_mean": statistics.fmean(f.num_tokens for f in frames)
            if frames else None,
            "gap_ms": _stats(gaps) | {"stutters": sum(
                g > STUTTER_FACTOR * period_s * 1e3 for g in gaps) if period_s else None},
            "errors": dict(errors),
        }


def _share(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def _stats(values: list[float]) -> dict:
    return {f"p{q}": percentile(values, q) for q in (50, 95, 99)} | {
        "max": max(values, default=None)}


async def run_load(config: LoadConfig, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    recorder = LoadRecorder()
    settings = ClientSettings(config.url, config.mode, config.sample_rate_hz, config.chunk_ms,
                              config.api_key)
    audio_dir = SPEECH_DIR if config.audio_dir is None else Path(config.audio_dir)
    speech = [speech_stream(audio_dir, config.sample_rate_hz, config.duration_s,
                            offset=i) for i in range(config.sessions)]  # before the clock
    origin_s = time.monotonic()
    tasks = [asyncio.create_task(_session(settings, i, pcm, at_s, origin_s, recorder))
             for i, (pcm, at_s) in enumerate(zip(speech, config.start_times_s(), strict=True))]
    with Live(_progress(recorder, 0.0), console=console, refresh_per_second=2) as live:
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.5)
            live.update(_progress(recorder, time.monotonic() - origin_s))
    await asyncio.gather(*tasks)
    return _write(config, recorder, time.monotonic() - origin_s)


async def _session(settings: ClientSettings, index: int, pcm: bytes, at_s: float,
                   origin_s: float, recorder: LoadRecorder) -> None:
    await asyncio.sleep(max(0.0, origin_s + at_s - time.monotonic()))
    recorder.started += 1
    client = SessionClient(settings, index, pcm, origin_s, recorder.frames.append)
    recorder.outcomes.append(await client.run())


def _write(config: LoadConfig, recorder: LoadRecorder, elapsed_s: float) -> dict:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    columns = [f.name for f in fields(FrameRecord)] + ["client_on_time"]
    with (out / "frames.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for frame in recorder.frames:
            writer.writerow([*asdict(frame).values(), frame.client_on_time])
    period_s = next((o.frame_period_s for o in recorder.outcomes if o.frame_period_s), None)
    summary = recorder.summary(period_s) | {
        "config": asdict(config) | {"api_key": bool(config.api_key)},
        "elapsed_s": elapsed_s,
        "outcomes": [asdict(o) for o in recorder.outcomes],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _progress(recorder: LoadRecorder, t_s: float) -> Table:
    frames = recorder.frames
    client = [f.client_latency_ms for f in frames if f.client_latency_ms is not None]
    outcomes = Counter(o.outcome for o in recorder.outcomes)
    table = Table(title=f"metronome load  t={t_s:.1f} s")
    for column in ("started", "active", "refused", "failed", "frames", "goodput",
                   "client p50 ms", "client p95 ms", "errors"):
        table.add_column(column)
    good = _share([f.good for f in frames])
    p50, p95 = percentile(client, 50), percentile(client, 95)
    table.add_row(
        str(recorder.started), str(recorder.started - len(recorder.outcomes)),
        str(outcomes["refused"]), str(outcomes["failed"] + outcomes["closed_by_server"]),
        str(len(frames)), "-" if good is None else f"{good:.1%}",
        "-" if p50 is None else f"{p50:.0f}", "-" if p95 is None else f"{p95:.0f}",
        str(sum(sum(o.errors.values()) for o in recorder.outcomes)),
    )
    return table
