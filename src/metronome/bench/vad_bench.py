"""`metronome bench vad`: server VAD (Silero in ONNX Runtime) on the espeak-ng fixtures.

1. Boundaries: each fixture twice, as 0.7 s silence + speech + 1.2 s + speech + 1.0 s, at
   16, 24 and 48 kHz, appended 20 ms at a time; the VAD's speech starts and stops against
   an energy gate's (`load.speech.speech_spans_ms`, no VAD), signed (positive: the VAD late).
2. Cost: milliseconds per 512-sample (32 ms) chunk: the network alone, and a whole push
   (decode, resample, network, turn rules) per chunk.
3. Threads: `torch.get_num_threads()` in a server process (this one, serving a tiny random
   model on a thread) before and after a `server_vad` session, whether `silero_vad` was
   imported, and the VAD thread's name; for contrast, a fresh interpreter before and after
   `import silero_vad`.

The report reads every setting and constant from the result.
"""

from __future__ import annotations

import base64
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from metronome.audio.silero import CHUNK_SAMPLES, SILERO_RATE_HZ, SileroState, SileroVad
from metronome.audio.turn_detector import SpeechStarted, SpeechStopped
from metronome.audio.vad import CHUNK_MS, VadStream
from metronome.load.speech import (
    GATE_BRIDGE_MS,
    GATE_WINDOW_MS,
    SENTENCES,
    SILENCE_LEVEL,
    speech_spans_ms,
    to_pcm16,
    utterances,
)
from metronome.results.context import RunContext
from metronome.results.provenance import describe

NAME = "vad"
OPENAI_DEFAULTS = {"threshold": 0.5, "silence_duration_ms": 500}  # server_vad's


@dataclass(frozen=True)
class Config:
    rates_hz: tuple[int, ...] = field(default=(16000, 24000, 48000), metadata={
        "help": "input sample rates, each fixture at each"})
    pauses_s: tuple[float, ...] = field(default=(0.7, 1.2, 1.0), metadata={
        "help": "silence before, between and after the fixture's two utterances"})
    append_ms: int = field(default=20, metadata={"help": "audio per append"})
    threshold: float = field(default=OPENAI_DEFAULTS["threshold"], metadata={
        "help": "server_vad threshold"})
    silence_duration_ms: int = field(default=OPENAI_DEFAULTS["silence_duration_ms"],
                                     metadata={"help": "server_vad silence_duration_ms"})
    tolerance_ms: float = field(default=100.0, metadata={
        "help": "the largest boundary error that passes"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(rates_hz=(16000,))


class TimedSilero:
    """The network, timing each call."""

    def __init__(self, model: SileroVad) -> None:
        self.model = model
        self.call_s: list[float] = []

    def speech_probability(self, state: SileroState, chunk: np.ndarray) -> float:
        started = time.perf_counter()
        probability = self.model.speech_probability(state, chunk)
        self.call_s.append(time.perf_counter() - started)
        return probability


def boundaries(cfg: Config, model: TimedSilero) -> tuple[list[dict], float, int]:
    """Rows of (rate, fixture, turn) with the truth, the VAD's and the error; the time spent
    in pushes and the chunks they judged."""
    rows, push_s, num_chunks = [], 0.0, 0
    for rate_hz in cfg.rates_hz:
        for name in sorted(SENTENCES):
            samples = utterances([name, name], rate_hz, list(cfg.pauses_s))
            truth = speech_spans_ms(samples, rate_hz)
            stream = VadStream(rate_hz, cfg.threshold, cfg.silence_duration_ms)
            pcm = to_pcm16(samples)
            step, events = round(rate_hz * cfg.append_ms / 1000) * 2, []
            started = time.perf_counter()
            for i in range(0, len(pcm), step):
                events += stream.push(model, pcm[i:i + step])
            push_s += time.perf_counter() - started
            num_chunks += stream.num_chunks
            starts = [e.start_ms for e in events if isinstance(e, SpeechStarted)]
            stops = [e.end_ms for e in events if isinstance(e, SpeechStopped)]
            if not len(starts) == len(stops) == len(truth):
                rows.append({"rate_hz": rate_hz, "fixture": name, "turn": None,
                             "error": f"{len(starts)} starts, {len(stops)} stops for "
                                      f"{len(truth)} utterances"})
                continue
            for turn, ((true_start, true_end), start, stop) in enumerate(
                    zip(truth, starts, stops, strict=True)):
                rows.append({"rate_hz": rate_hz, "fixture": name, "turn": turn,
                             "true_start_ms": true_start, "vad_start_ms": start,
                             "start_error_ms": start - true_start,
                             "true_end_ms": true_end, "vad_end_ms": stop,
                             "end_error_ms": stop - true_end})
    return rows, push_s, num_chunks


def server_threads() -> dict:
    """A server_vad session against a server in this process: torch's threads around it."""
    from websockets.sync.client import connect

    from metronome.model.config import TINY_LLAMA
    from metronome.model.weights import random_model
    from metronome.serve.config import ServerConfig
    from metronome.serve.server import ServerThread

    before = torch.get_num_threads()
    config = ServerConfig(policy="sinks_window:4:64", pool_tokens=4096, admission="off",
                          sample_rates_hz=(16000,), default_sample_rate_hz=16000)
    pcm = to_pcm16(utterances(["weather"], 16000, [0.5, 0.8]))
    model = random_model(TINY_LLAMA, torch.float32, seed=1)
    with ServerThread(config, model) as server, connect(server.ws_url) as ws:
        ws.recv(timeout=10)
        ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}}}}))
        ws.recv(timeout=10)
        for i in range(0, len(pcm), 3200):  # 100 ms appends
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(pcm[i:i + 3200]).decode()}))
        seen = []
        while "input_audio_buffer.speech_stopped" not in seen:
            seen.append(json.loads(ws.recv(timeout=30))["type"])
        vad_threads = sorted(t.name for t in threading.enumerate() if "vad" in t.name)
    return {"torch_threads_before": before, "torch_threads_after": torch.get_num_threads(),
            "silero_vad_imported": "silero_vad" in sys.modules, "vad_threads": vad_threads,
            "speech_events": [t for t in seen if t.startswith("input_audio_buffer.speech")]}


def package_import_threads() -> dict:
    """What importing the silero_vad package does to torch's threads (a fresh interpreter)."""
    program = ("import torch; n = torch.get_num_threads(); import silero_vad; "
               "print(n, torch.get_num_threads())")
    before, after = subprocess.run([sys.executable, "-c", program], capture_output=True,
                                   text=True, check=True).stdout.split()
    return {"before_import": int(before), "after_import": int(after)}


def _ms_stats(seconds: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in seconds)
    return {"median_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))],
            "mean_ms": statistics.fmean(ms), "calls": len(ms)}


def run(ctx: RunContext, cfg: Config) -> dict:
    ctx.record(model="Silero VAD (ONNX Runtime)", dtype="float32",
               engine_path="not used (the network runs in ONNX Runtime)")
    threads_at_start = torch.get_num_threads()
    load_started = time.perf_counter()
    model = TimedSilero(SileroVad())
    load_ms = (time.perf_counter() - load_started) * 1e3
    rows, push_s, num_chunks = boundaries(cfg, model)
    ctx.keep("boundaries", rows)
    errors = [abs(r[k]) for r in rows if "error" not in r for k in ("start_error_ms",
                                                                    "end_error_ms")]
    push_per_chunk_ms = push_s * 1e3 / num_chunks
    return {
        "config": asdict(cfg),
        "gate": {"window_ms": GATE_WINDOW_MS, "level_dbfs": 20 * math.log10(SILENCE_LEVEL),
                 "bridge_ms": GATE_BRIDGE_MS},
        "chunk": {"samples": CHUNK_SAMPLES, "rate_hz": SILERO_RATE_HZ, "ms": CHUNK_MS},
        "openai_defaults": OPENAI_DEFAULTS,
        "boundaries": rows,
        "max_abs_error_ms": max(errors) if errors else None,
        "within_tolerance": bool(errors) and max(errors) <= cfg.tolerance_ms
        and all("error" not in r for r in rows),
        "cost": {"model_load_ms": load_ms, "network_per_chunk": _ms_stats(model.call_s),
                 "push_per_chunk_ms": push_per_chunk_ms,
                 "realtime_share_of_one_core": push_per_chunk_ms / CHUNK_MS},
        "threads": {"bench_process_at_start": threads_at_start,
                    "bench_process_after_vad": torch.get_num_threads(),
                    "server": server_threads(), "silero_vad_package": package_import_threads()},
    }


def _layout(pauses_s: list[float]) -> str:
    """The fixture's layout, e.g. "0.7 s silence + speech + 1.2 s + speech + 1.0 s"."""
    parts = [f"{pauses_s[0]:g} s silence"]
    for pause in pauses_s[1:]:
        parts += ["speech", f"{pause:g} s"]
    return " + ".join(parts)


def report(result: dict) -> str:
    cfg, cost, threads = result["config"], result["cost"], result["threads"]
    server, package = threads["server"], threads["silero_vad_package"]
    network, gate, chunk = cost["network_per_chunk"], result["gate"], result["chunk"]
    openai = {k: cfg[k] for k in result["openai_defaults"]} == result["openai_defaults"]
    defaults_note = " (OpenAI's defaults)" if openai else ""
    lines = [
        "# Server VAD: Silero on the espeak-ng fixtures", "",
        describe(result["provenance"]), "",
        f"Command: `{result['command']}`. Written by the command; do not edit by hand. "
        f"1-min load {result['provenance']['machine']['load_avg_1m_start']:.1f} at the "
        "start.", "",
        f"Settings: threshold {cfg['threshold']}, silence_duration_ms "
        f"{cfg['silence_duration_ms']}{defaults_note}, {cfg['append_ms']} ms appends, at "
        f"{', '.join(map(str, cfg['rates_hz']))} Hz. Each "
        f"fixture twice, as {_layout(cfg['pauses_s'])}. Truth: an energy gate "
        f"({gate['window_ms']:g} ms windows over {gate['level_dbfs']:.0f} dBFS, gaps under "
        f"{gate['bridge_ms']:g} ms bridged), no VAD. Errors are signed: positive, the VAD is "
        "late.", "",
        "## Boundaries", "",
        "| rate (Hz) | fixture | turn | true start (ms) | VAD start | error | true end (ms) "
        "| VAD end | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["boundaries"]:
        if "error" in r:
            lines.append(f"| {r['rate_hz']} | {r['fixture']} | - | {r['error']} |||||")
            continue
        lines.append(f"| {r['rate_hz']} | {r['fixture']} | {r['turn']} | "
                     f"{r['true_start_ms']:.0f} | {r['vad_start_ms']:.0f} | "
                     f"{r['start_error_ms']:+.0f} | {r['true_end_ms']:.0f} | "
                     f"{r['vad_end_ms']:.0f} | {r['end_error_ms']:+.0f} |")
    verdict = "within" if result["within_tolerance"] else "NOT within"
    largest = result["max_abs_error_ms"]
    lines += [
        "", f"Largest error: {'-' if largest is None else f'{largest:.0f}'} ms ({verdict} "
        f"{cfg['tolerance_ms']:.0f} ms).", "",
        "## Cost", "",
        f"- network per {chunk['samples']}-sample chunk ({chunk['ms']:g} ms of audio at "
        f"{chunk['rate_hz']} Hz): median {network['median_ms']:.3f} ms, p99 "
        f"{network['p99_ms']:.3f} ms, mean {network['mean_ms']:.3f} ms over "
        f"{network['calls']} chunks (ONNX Runtime, with `audio.silero.SileroVad`'s "
        "single-threaded session options)",
        f"- a whole push per chunk (decode, resample, network, rules): "
        f"{cost['push_per_chunk_ms']:.3f} ms, {cost['realtime_share_of_one_core']:.1%} of "
        "one core per real-time stream",
        f"- loading the network: {cost['model_load_ms']:.0f} ms (once per server, on the "
        "VAD thread)", "",
        "## Threads", "",
        f"- server process (this one, `metronome serve` on a thread): "
        f"`torch.get_num_threads()` {server['torch_threads_before']} before a server_vad "
        f"session, {server['torch_threads_after']} after; `silero_vad` imported: "
        f"{server['silero_vad_imported']}; VAD thread: {', '.join(server['vad_threads'])}; "
        f"events: {', '.join(server['speech_events'])}",
        f"- for contrast, a fresh interpreter: {package['before_import']} before `import "
        f"silero_vad`, {package['after_import']} after (why the package is never imported)",
        "", "Raw results: the JSON beside this file.", "",
    ]
    return "\n".join(lines)
