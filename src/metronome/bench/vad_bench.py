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

Writes JSON and a markdown report with the command and the machine.
"""

from __future__ import annotations

import base64
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from metronome.audio.silero import SileroState, SileroVad
from metronome.audio.turn_detector import SpeechStarted, SpeechStopped
from metronome.audio.vad import VadStream
from metronome.bench.engine.machine import machine
from metronome.load.speech import SENTENCES, speech_spans_ms, to_pcm16, utterances

COMMAND = "metronome bench vad"
RATES_HZ = (16000, 24000, 48000)
PAUSES_S = [0.7, 1.2, 1.0]
APPEND_MS = 20
THRESHOLD, SILENCE_DURATION_MS = 0.5, 500  # OpenAI's server_vad defaults
TOLERANCE_MS = 100.0


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


def boundaries(model: TimedSilero) -> tuple[list[dict], float, int]:
    """Rows of (rate, fixture, turn) with the truth, the VAD's and the error; the time spent
    in pushes and the chunks they judged."""
    rows, push_s, num_chunks = [], 0.0, 0
    for rate_hz in RATES_HZ:
        for name in sorted(SENTENCES):
            samples = utterances([name, name], rate_hz, PAUSES_S)
            truth = speech_spans_ms(samples, rate_hz)
            stream, pcm = VadStream(rate_hz, THRESHOLD, SILENCE_DURATION_MS), to_pcm16(samples)
            step, events = round(rate_hz * APPEND_MS / 1000) * 2, []
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


def run(out_md: str, out_json: str) -> dict:
    threads_at_start = torch.get_num_threads()
    load_started = time.perf_counter()
    model = TimedSilero(SileroVad())
    load_ms = (time.perf_counter() - load_started) * 1e3
    rows, push_s, num_chunks = boundaries(model)
    errors = [abs(r[k]) for r in rows if "error" not in r for k in ("start_error_ms",
                                                                    "end_error_ms")]
    result = {
        "command": COMMAND, "machine": machine("default"),
        "settings": {"threshold": THRESHOLD, "silence_duration_ms": SILENCE_DURATION_MS,
                     "append_ms": APPEND_MS, "pauses_s": PAUSES_S},
        "boundaries": rows,
        "max_abs_error_ms": max(errors) if errors else None,
        "within_tolerance": bool(errors) and max(errors) <= TOLERANCE_MS
        and all("error" not in r for r in rows),
        "cost": {"model_load_ms": load_ms, "network_per_chunk": _ms_stats(model.call_s),
                 "push_per_chunk_ms": push_s * 1e3 / num_chunks,
                 "realtime_share_of_one_core": push_s * 1e3 / num_chunks / 32.0},
        "threads": {"bench_process_at_start": threads_at_start,
                    "bench_process_after_vad": torch.get_num_threads(),
                    "server": server_threads(), "silero_vad_package": package_import_threads()},
    }
    Path(out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(out_json).write_text(json.dumps(result, indent=2))
    Path(out_md).write_text(report(result, Path(out_json).name))
    print(json.dumps({k: result[k] for k in ("max_abs_error_ms", "within_tolerance", "cost",
                                             "threads")}, indent=2))
    return result


def report(result: dict, json_name: str) -> str:
    m, cost, threads = result["machine"], result["cost"], result["threads"]
    server, package = threads["server"], threads["silero_vad_package"]
    network = cost["network_per_chunk"]
    lines = [
        "# Server VAD: Silero on the espeak-ng fixtures", "",
        f"Command: `{result['command']}`. Written by the command; do not edit by hand.", "",
        f"Machine: {m['cpu_model']}, {m['logical_cpus']} logical CPUs, "
        f"{m['memory_gib']:.0f} GiB, Python {m['python']}, torch {m['torch']} "
        f"(1-min load {m['load_avg_1m_start']:.1f} at the start).", "",
        f"Settings: threshold {result['settings']['threshold']}, silence_duration_ms "
        f"{result['settings']['silence_duration_ms']} (OpenAI's defaults), "
        f"{result['settings']['append_ms']} ms appends. Each fixture twice, as "
        "0.7 s silence + speech + 1.2 s + speech + 1.0 s. Truth: an energy gate (10 ms "
        "windows over -40 dBFS, gaps under 300 ms bridged), no VAD. Errors are signed: "
        "positive, the VAD is late.", "",
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
    lines += [
        "", f"Largest error: {result['max_abs_error_ms']:.0f} ms ({verdict} "
        f"{TOLERANCE_MS:.0f} ms).", "",
        "## Cost", "",
        f"- network per 512-sample chunk (32 ms of audio): median {network['median_ms']:.3f} "
        f"ms, p99 {network['p99_ms']:.3f} ms, mean {network['mean_ms']:.3f} ms over "
        f"{network['calls']} chunks (ONNX Runtime, 1 thread)",
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
        "", f"Raw results: `{json_name}` beside this file.", "",
    ]
    return "\n".join(lines)
