"""`metronome bench vad`: server VAD (Silero in ONNX Runtime) on the espeak-ng fixtures.

Boundaries: each fixture twice (`pauses_s` of silence before, between and after), at each
rate, appended `append_ms` at a time through `audio.vad.VadStream`; its speech starts and
stops against an energy gate's (`load.speech.speech_spans_ms`, no VAD), signed (positive:
the VAD late). Cost (`bench.steps`): every push timed, over the 512-sample (32 ms) chunks it
judged; and the network alone, per chunk. Derived number: ms of a whole push per chunk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from metronome.bench.presets import knob
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived

NAME = "vad"


@dataclass(frozen=True)
class Config:
    rates_hz: tuple[int, ...] = knob((16000, 24000, 48000), "input rates, each fixture at each")
    pauses_s: tuple[float, ...] = knob((0.7, 1.2, 1.0), "silence before, between and after "
                                       "the fixture's two utterances")
    append_ms: int = knob(20, "audio per append")
    threshold: float = knob(0.5, "server_vad threshold")
    silence_duration_ms: int = knob(500, "server_vad silence_duration_ms")

    @classmethod
    def smoke(cls) -> Config:
        return cls(rates_hz=(16000,))


def pushed(model, stream, appends: list[bytes]) -> tuple[list, float]:
    """Every append pushed through `stream`, each timed: the events, the seconds in all."""
    from metronome.bench.steps import interleave

    events, pieces = [], iter(appends)
    times = interleave({"push": lambda: events.extend(stream.push(model, next(pieces)))},
                       len(appends), warmup=0)
    return events, sum(map(sum, times["push"]))


def run(ctx: RunContext, cfg: Config) -> dict:
    import numpy as np

    from metronome.audio.silero import CHUNK_SAMPLES, SileroState, SileroVad
    from metronome.audio.turn_detector import SpeechStarted, SpeechStopped
    from metronome.audio.vad import CHUNK_MS, VadStream
    from metronome.bench.steps import interleave, stats
    from metronome.load.speech import SENTENCES, speech_spans_ms, to_pcm16, utterances

    ctx.record(model="Silero VAD (ONNX Runtime)", dtype="float32", engine_path="not used")
    model, rows, push_s, chunks_judged = SileroVad(), [], 0.0, 0
    for rate in cfg.rates_hz:
        for name in sorted(SENTENCES):
            samples = utterances([name, name], rate, list(cfg.pauses_s))
            stream = VadStream(rate, cfg.threshold, cfg.silence_duration_ms)
            pcm, size = to_pcm16(samples), round(rate * cfg.append_ms / 1000) * 2
            events, seconds = pushed(model, stream, [pcm[i:i + size]
                                                     for i in range(0, len(pcm), size)])
            push_s += seconds
            chunks_judged += stream.num_chunks
            starts = [e.start_ms for e in events if isinstance(e, SpeechStarted)]
            stops = [e.end_ms for e in events if isinstance(e, SpeechStopped)]
            truth = speech_spans_ms(samples, rate)
            for turn, (true_start, true_end) in enumerate(truth):
                start, stop = (starts[turn] if turn < len(starts) else None,
                               stops[turn] if turn < len(stops) else None)
                rows.append({"rate_hz": rate, "fixture": name, "turn": turn,
                             "true_start_ms": true_start, "vad_start_ms": start,
                             "start_error_ms": None if start is None else start - true_start,
                             "true_end_ms": true_end, "vad_end_ms": stop,
                             "end_error_ms": None if stop is None else stop - true_end})
            ctx.keep("boundaries", rows)
    speech = utterances([sorted(SENTENCES)[0]], 16000, [0.2, 0.2]).astype(np.float32)
    chunks, state = iter(speech[k:k + CHUNK_SAMPLES] for k in range(
        0, len(speech) - CHUNK_SAMPLES + 1, CHUNK_SAMPLES)), SileroState()
    network = stats(interleave({"network": lambda: model.speech_probability(
        state, next(chunks))}, len(speech) // CHUNK_SAMPLES - 1)["network"])
    errors = [abs(r[k]) for r in rows for k in ("start_error_ms", "end_error_ms")
              if r[k] is not None]
    per_chunk_ms = push_s * 1e3 / chunks_judged
    cost = {"push_per_chunk_ms": per_chunk_ms, "chunk_ms": CHUNK_MS,
            "share_of_one_core": per_chunk_ms / CHUNK_MS, "network_median_ms":
            network["median_ms"], "network_p95_ms": network["p95_ms"], "chunks": chunks_judged,
            "largest_boundary_error_ms": max(errors, default=None),
            "turns_missed": sum(r["vad_start_ms"] is None or r["vad_end_ms"] is None
                                for r in rows)}
    return REPORT.finish(ctx, {"config": asdict(cfg), "boundaries": rows, "cost": cost,
                               "derived": derived(f"ms of a whole push (decode, resample, "
                                                  f"network, turn rules) per {CHUNK_MS:g} ms "
                                                  "chunk", per_chunk_ms)})


REPORT = Report("Server VAD: Silero on the espeak-ng fixtures", spec=".3f", tables=(
    Table("Summary", "cost"),
    Table("Boundaries against an energy gate (error > 0: the VAD late)", "boundaries", (
        ("rate Hz", "rate_hz", ""), ("fixture", "fixture", ""), ("turn", "turn", ""),
        ("true start ms", "true_start_ms", ".0f"), ("VAD start", "vad_start_ms", ".0f"),
        ("error", "start_error_ms", "+.0f"), ("true end ms", "true_end_ms", ".0f"),
        ("VAD end", "vad_end_ms", ".0f"), ("error", "end_error_ms", "+.0f")))))
report = REPORT.markdown
