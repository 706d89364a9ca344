"""`metronome bench ear`: what a Whisper pass costs and hears by its window. Whisper tiny.en
(CTranslate2 int8) hears max(clip, W) seconds per pass (`audio.whisper.Whisper(window_s=W)`)
against faster-whisper's `transcribe()`, which pads every pass to 30 s (the reference): the pass
time by clip length (the fastest of `repeats`), and the word error rate by speech source —
Piper (the served voice), espeak-ng (the shipped fixtures and the same prompts synthesized when
Debian's `espeak-ng` is there) and a human speaker (the ALSA test voice, read from Debian's
alsa-utils package at run time, never committed) — with the clips whose words a guard cut
(a phrase looped three times or more). Derived number: the smallest window whose word error
rate is within `max_wer_rise` of the reference's on every source and on which no clip needed the
loop guard (the server's default).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from metronome.audio.whisper import WHISPER_RATE_HZ, Whisper
from metronome.bench.presets import Knobs, knob
from metronome.bench.presets.voice import ALSA_CLIPS, QUESTIONS, alsa_clips, to16k, wer
from metronome.load.speech import SENTENCES, SPEECH_DIR, read_wav
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "ear"
REFERENCE = "30 s (transcribe)"
# typical voice-agent prompts, 0.6-5 s spoken (`research`: the window's loops show on the
# shortest, "Yes.")
PROMPTS = [
    "What will the weather be like tomorrow?", "Please book a table for two at seven.",
    "How far is the train station from here?",
    "Can you remind me to call my sister at five thirty this evening?",
    "I would like to change my flight to Thursday morning if there is a seat available.",
    "Turn off the lights in the kitchen.", "What is the capital of Australia?",
    "Tell me a short story about a dragon who is afraid of the dark.",
    "My order number is four five seven two and it still has not arrived.",
    "Could you explain how photosynthesis works in simple terms?", "Yes.",
    "No thanks, that is all for today.", "Set a timer for twelve minutes.",
    "I think the meeting should be moved to next week because half the team is on holiday.",
    "Play some relaxing jazz music.", "How many kilometers are there in a marathon?",
]


@dataclass(frozen=True)
class Config(Knobs):
    windows_s: tuple[float, ...] = knob((10.0, 8.0, 6.0), "the windows compared with 30 s")
    clips_s: tuple[float, ...] = knob((1.0, 2.0, 4.0, 8.0, 16.0), "clip lengths timed")
    threads: int = knob(1, "threads of one Whisper pass (the server's default: 1)")
    repeats: int = knob(3, "timed repeats of each pass (the fastest is kept)")
    max_wer_rise: float = knob(0.015, "how much word error a window may add on any source")
    human: bool = knob(True, "fetch the ALSA test voice (Debian's alsa-utils) for a human set")
    piper_takes: int = knob(3, "times Piper speaks each prompt (it samples each take afresh: "
                               "one take's luck moved a window's word error by 5 points)")

    SMOKE = dict(windows_s=(10.0,), clips_s=(1.0, 4.0), repeats=1, human=False, piper_takes=1)


def speech_sets(ctx: RunContext, cfg: Config) -> dict[str, list[tuple[str, np.ndarray]]]:
    """(reference text, 16 kHz samples) by source."""
    from metronome.audio.voice import Voice

    voice = Voice()
    texts = list(dict.fromkeys(PROMPTS + QUESTIONS + list(SENTENCES.values())))
    sets = {"Piper (the served voice)": [
        (text, np.frombuffer(voice.speak(text, WHISPER_RATE_HZ), "<i2").astype(np.float32)
         / 32768) for text in texts for _ in range(cfg.piper_takes)]}
    espeak = [(text, to16k(*read_wav(SPEECH_DIR / f"{name}.wav")))
              for name, text in SENTENCES.items()]
    if shutil.which("espeak-ng"):
        espeak += [(text, _espeak(text)) for text in PROMPTS + QUESTIONS]
    else:
        ctx.log("espeak-ng is not installed: the espeak set is the three shipped fixtures")
    sets["espeak-ng"] = espeak
    if cfg.human:
        human = alsa_clips(ctx)
        if human:
            sets["human (ALSA test voice)"] = [(ALSA_CLIPS[name], samples)
                                               for name, samples in human.items()]
    return sets


def _espeak(text: str) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "say.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "165", "-w", str(path), text],
                       check=True, capture_output=True, timeout=60)
        return to16k(*read_wav(path))


def heard(whisper: Whisper, sets: dict) -> list[dict]:
    rows = []
    for source, clips in sets.items():
        for text, samples in clips:
            cut_before = whisper.loops_cut
            words = " ".join(whisper.words(samples))
            rows.append({"source": source, "reference": text, "heard": words,
                         "wer": wer(text, words), "loop_cut": whisper.loops_cut > cut_before})
    return rows


def pass_times(whisper: Whisper, speech: np.ndarray, cfg: Config) -> list[dict]:
    rows = []
    for clip_s in cfg.clips_s:
        clip = np.resize(speech, int(clip_s * WHISPER_RATE_HZ))  # speech looped to length
        times = []
        for _ in range(cfg.repeats):
            started = time.perf_counter()
            whisper.words(clip)
            times.append(time.perf_counter() - started)
        rows.append({"clip_s": clip_s, "pass_ms": 1e3 * min(times),
                     "ms_per_audio_s": 1e3 * min(times) / clip_s})
    return rows


def run(ctx: RunContext, cfg: Config) -> dict:
    ctx.record(model="Whisper tiny.en int8 (CTranslate2)", dtype="int8",
               engine_path="not used", whisper_threads=cfg.threads)
    sets = speech_sets(ctx, cfg)
    ctx.log("speech sets: " + ", ".join(f"{s} {len(c)} clips" for s, c in sets.items()))
    speech = np.concatenate([samples for _, samples in sets["Piper (the served voice)"]
                             [::cfg.piper_takes]])
    arms: list[tuple[str, float | None]] = [(REFERENCE, None)] + [
        (f"{w:g} s", w) for w in cfg.windows_s]
    costs, transcripts, by_source = [], [], []
    for arm, window_s in arms:
        ctx.log(f"window {arm}: hearing {sum(map(len, sets.values()))} clips")
        whisper = Whisper(cfg.threads, window_s=window_s)
        whisper.words(np.zeros(WHISPER_RATE_HZ, np.float32))  # its kernels set up
        rows = heard(whisper, sets)
        transcripts += [{"window": arm} | r for r in rows]
        costs += [{"window": arm, "window_s": 30.0 if window_s is None else window_s} | r
                  for r in pass_times(whisper, speech, cfg)]
        for source in sets:
            mine = [r for r in rows if r["source"] == source]
            by_source.append({"window": arm, "source": source, "clips": len(mine),
                              "wer": statistics.mean(r["wer"] for r in mine),
                              "loops_cut": sum(r["loop_cut"] for r in mine)})
    reference = {r["source"]: r["wer"] for r in by_source if r["window"] == REFERENCE}
    for row in by_source:
        row["wer_rise"] = row["wer"] - reference[row["source"]]
    # a window fits when its word error is within `max_wer_rise` on every source and none of
    # its clips needed the loop guard: one that did is at the edge where tiny.en loops
    fits = [w for w in cfg.windows_s
            if all(r["wer_rise"] <= cfg.max_wer_rise and not r["loops_cut"] for r in by_source
                   if r["window"] == f"{w:g} s")]
    result = {"config": asdict(cfg), "wer": by_source, "pass_times": costs,
              "transcripts": transcripts}
    result["derived"] = derived(
        f"smallest window with word error within {cfg.max_wer_rise * 100:g} points of 30 s on "
        "every source and no loop cut (s; none: no window did)", min(fits, default=None))
    return REPORT.finish(ctx, result)


REPORT = Report("The ear: Whisper's cost and word error by window", spec="g", tables=(
    Table("Word error rate by window and source (rise: against 30 s)", "wer"),
    Table("One pass by clip length (speech looped to length)", "pass_times"),
    Table("Transcripts", "transcripts")),
    plots=(Plot("{stem}.png", "pass_times", x="clip_s", ys=("pass_ms",), series="window"),))
report = REPORT.markdown
