"""`metronome bench vad`: server VAD (Silero in ONNX Runtime) on the espeak-ng fixtures. Each
fixture twice (`pauses_s` of silence before, between and after), at each rate, appended
`append_ms` at a time through `audio.vad.VadStream`, every push timed (`bench.steps`); its
speech starts and stops against an energy gate's (`load.speech.speech_spans_ms`, no VAD),
signed (positive: the VAD late). Derived number: the ms of pushes per 32 ms chunk judged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from metronome.audio.silero import SileroVad
from metronome.audio.turn_detector import SpeechStarted, SpeechStopped
from metronome.audio.vad import CHUNK_MS, VadStream
from metronome.bench.presets import Knobs, knob
from metronome.bench.steps import interleave
from metronome.load.speech import SENTENCES, speech_spans_ms, to_pcm16, utterances
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived

NAME = "vad"


@dataclass(frozen=True)
class Config(Knobs):
    rates_hz: tuple[int, ...] = knob((16000, 24000, 48000), "input rates, each fixture at each")
    pauses_s: tuple[float, ...] = knob((0.7, 1.2, 1.0), "silence before, between and after "
                                       "the fixture's two utterances")
    append_ms: int = knob(20, "audio per append")
    threshold: float = knob(0.5, "server_vad threshold")
    silence_duration_ms: int = knob(500, "server_vad silence_duration_ms")

    SMOKE = dict(rates_hz=(16000,))


def pushed(model, stream, appends: list[bytes]) -> tuple[list, float]:
    """Every append pushed through `stream`, each timed: the events, the seconds in all."""
    events, pieces = [], iter(appends)
    times = interleave({"push": lambda: events.extend(stream.push(model, next(pieces)))},
                       len(appends), warmup=0)
    return events, sum(map(sum, times["push"]))


def run(ctx: RunContext, cfg: Config) -> dict:
    ctx.record(model="Silero VAD (ONNX Runtime)", dtype="float32", engine_path="not used")
    model, rows, push_s, chunks = SileroVad(), [], 0.0, 0
    for rate in cfg.rates_hz:
        for name in sorted(SENTENCES):
            samples = utterances([name, name], rate, list(cfg.pauses_s))
            stream = VadStream(rate, cfg.threshold, cfg.silence_duration_ms)
            pcm, size = to_pcm16(samples), round(rate * cfg.append_ms / 1000) * 2
            events, seconds = pushed(model, stream, [pcm[i:i + size]
                                                     for i in range(0, len(pcm), size)])
            push_s, chunks = push_s + seconds, chunks + stream.num_chunks
            starts = [e.start_ms for e in events if isinstance(e, SpeechStarted)]
            stops = [e.end_ms for e in events if isinstance(e, SpeechStopped)]
            for turn, (true_start, true_end) in enumerate(speech_spans_ms(samples, rate)):
                start = starts[turn] if turn < len(starts) else None
                stop = stops[turn] if turn < len(stops) else None
                rows.append({"rate_hz": rate, "fixture": name, "turn": turn,
                             "true_start_ms": true_start, "vad_start_ms": start,
                             "start_error_ms": None if start is None else start - true_start,
                             "true_end_ms": true_end, "vad_end_ms": stop,
                             "end_error_ms": None if stop is None else stop - true_end})
    errors = [abs(r[k]) for r in rows for k in ("start_error_ms", "end_error_ms")
              if r[k] is not None]
    cost = {"push_ms_per_chunk": push_s * 1e3 / chunks, "chunk_ms": CHUNK_MS, "chunks": chunks,
            "share_of_one_core": push_s * 1e3 / chunks / CHUNK_MS,
            "largest_boundary_error_ms": max(errors, default=None),
            "turns_without_a_boundary": sum(r["vad_start_ms"] is None or r["vad_end_ms"] is None
                                            for r in rows)}
    return REPORT.finish(ctx, {"config": asdict(cfg), "cost": cost, "boundaries": rows,
                               "derived": derived(f"ms of pushes (decode, resample, network, "
                                                  f"turn rules) per {CHUNK_MS:g} ms chunk",
                                                  cost["push_ms_per_chunk"])})


REPORT = Report("Server VAD: Silero on the espeak-ng fixtures", spec=".3f", tables=(
    Table("Cost and boundaries", "cost"),
    Table("Boundaries against an energy gate (error > 0: the VAD late)", "boundaries")))
report = REPORT.markdown
