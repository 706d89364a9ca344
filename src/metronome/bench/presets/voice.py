"""`metronome bench voice`: the cost of hearing and speaking. Stages in this process: Whisper
tiny.en's pass time by clip length, Piper's real-time factor, the word error rate of the
transcription on Piper speech, the espeak-ng fixtures and a human recording (the ALSA test
voice, read from Debian's alsa-utils package at run time, GPL-2, never committed), and the
resident memory each model adds. Then sessions against `metronome serve`: N concurrent voice
sessions, each speaking `turns` questions at real-time pace with server VAD (staggered
starts), timed from the client's side: time to first audio (the end of the question's speech
in the audio sent, to the first `response.output_audio.delta`) and from `speech_stopped`, at
each N; the same with `--audio-input embeddings --no-output-audio` (the stand-in encoder and
text: time to the reply's text) for contrast. Derived number: the largest N whose p95 time
to first audio is within `budget_ms`.

`--answers long` asks for long spoken answers instead ("Tell me about Paris in detail."):
each reply runs to the model's stop or the server's `--max-response-tokens`, and each
session listens to it as a person does: its microphone keeps sending silence at real time
until the reply's audio would have finished playing, then it asks the next question. The
reply's audio is played, on the client, at real time from its first delta (`Playback`,
the server's own listener model, here on the client's clock): a delta that arrives after
what came before has run out is a **gap** the listener hears. Per N: replies completed
(the model's stop, or its budget: `incomplete` for `max_output_tokens`), output tokens,
gaps per reply (count, ms, the p95 of a reply's total), time to first audio. The goal: no
gaps at any N where the time-to-first-audio budget holds.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

from metronome.audio.whisper import normalise_word
from metronome.bench.presets import Knobs, knob
from metronome.bench.server import Server, served_facts
from metronome.load.client import Connection
from metronome.load.speech import SENTENCES, SPEECH_DIR, read_wav, resample
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived
from metronome.serve.realtime.pacing import Playback
from metronome.stats import percentile

NAME = "voice"
RATE_HZ = 24000
CHUNK_S = 0.1
QUESTIONS = ["What is the capital of France?", "How far is the moon from the earth?",
             "What colour is the sky on a clear day?", "Name a large animal that lives in Africa."]
LONG_QUESTIONS = ["Tell me about Paris in detail.",
                  "Describe the moon and how people reached it.",
                  "Explain how a river is formed, step by step.",
                  "Tell me the history of the city of Rome."]
ALSA_CLIPS = {"Front_Center": "front center", "Front_Left": "front left",
              "Front_Right": "front right", "Rear_Center": "rear center",
              "Rear_Left": "rear left", "Rear_Right": "rear right",
              "Side_Left": "side left", "Side_Right": "side right"}
VOICE = ["--mode", "turn", "--audio-input", "transcribe", "--output-audio", "--server-vad"]
ARMS = {  # the serve flags of each arm (after the bench launcher's text-server defaults)
    "voice": VOICE,
    # as before the ear (`metronome bench ear`): every Whisper pass hears 30 s
    # the ear as it was: every pass 30 s, the turn's last pass at its commit
    "voice, 30 s passes": [*VOICE, "--whisper-window-s", "30", "--hear-ahead-pause-ms", "0"],
    # the speak stage as before issue 51: first asked, first spoken
    "voice, speak in arrival order": [*VOICE, "--speak-order", "arrival"],
    "embeddings+text": ["--mode", "turn", "--audio-input", "embeddings", "--no-output-audio",
                        "--server-vad"],
}
SPOKEN = ("voice", "voice, 30 s passes", "voice, speak in arrival order")  # answer in audio


@dataclass(frozen=True)
class Config(Knobs):
    sessions: tuple[int, ...] = knob((1, 2, 4, 8), "concurrent voice sessions, one run each")
    turns: int = knob(3, "questions each session speaks")
    arms: tuple[str, ...] = knob(("voice", "embeddings+text"), " | ".join(ARMS))
    budget_ms: float = knob(800.0, "the time-to-first-audio budget for the derived number")
    silence_duration_ms: int = knob(500, "server VAD's silence that ends a turn (OpenAI's)")
    whisper_threads: int = knob(1, "threads of one Whisper pass")
    repeats: int = knob(3, "timed repeats of each stage measurement")
    answers: str = knob("short", "short | long: questions with one-sentence answers, or "
                        "asking for long spoken ones (listened to in full; gaps counted)")
    stages_too: bool = knob(True, "measure the stages in this process first")

    SMOKE = dict(sessions=(1,), turns=1, arms=("voice",), repeats=1)


# ---- stages, in this process -------------------------------------------------------------------
def wer(reference: str, hypothesis: str) -> float:
    """Word error rate: word-level edit distance over the reference's words (normalised)."""
    ref, hyp = _words(reference), _words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1] / max(1, len(ref))


def _words(text: str) -> list[str]:
    return [w for w in map(normalise_word, text.split()) if w]


def to16k(samples: np.ndarray, rate_hz: int) -> np.ndarray:
    return resample(samples, rate_hz, 16000).astype(np.float32)


def alsa_clips(ctx: RunContext) -> dict[str, np.ndarray]:
    """The ALSA test voice (a human speaker), from Debian's alsa-utils package; {} if apt
    cannot fetch it (said in the log)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(["apt-get", "download", "alsa-utils"], cwd=tmp, check=True,
                           capture_output=True, timeout=120)
            deb = next(Path(tmp).glob("alsa-utils_*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True, timeout=60)
        except (OSError, subprocess.SubprocessError, StopIteration) as err:
            ctx.log(f"no human recording: alsa-utils could not be fetched ({err})")
            return {}
        sounds = Path(tmp) / "usr/share/sounds/alsa"
        return {name: to16k(*read_wav(sounds / f"{name}.wav")) for name in ALSA_CLIPS
                if (sounds / f"{name}.wav").exists()}


def stages(ctx: RunContext, cfg: Config) -> dict:
    from metronome.audio.voice import Voice
    from metronome.audio.whisper import Whisper
    from metronome.model.weights import load_model

    process = psutil.Process()
    rss = [("nothing loaded", process.memory_info().rss)]
    load_model("bundled")
    rss.append(("+ SmolLM2-135M (the LM)", process.memory_info().rss))
    whisper = Whisper(cfg.whisper_threads)
    rss.append(("+ Whisper tiny.en (int8)", process.memory_info().rss))
    voice = Voice()
    rss.append(("+ Piper en_US joe medium", process.memory_info().rss))
    memory = [{"what": what, "rss_mib": b / 2**20, "added_mib": (b - rss[i - 1][1]) / 2**20
               if i else None} for i, (what, b) in enumerate(rss)]

    piper, speech = [], {}
    for text in QUESTIONS + list(SENTENCES.values()):
        times = []
        for _ in range(cfg.repeats):
            start = time.perf_counter()
            pcm = voice.speak(text, 16000)
            times.append(time.perf_counter() - start)
        audio_s = len(pcm) / 2 / 16000
        speech[text] = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
        piper.append({"text": text, "audio_s": audio_s, "synth_ms": 1e3 * min(times),
                      "real_time_factor": min(times) / audio_s})

    passes = []
    joined = np.concatenate(list(speech.values()))
    for clip_s in (1.0, 2.0, 4.0, 8.0):
        clip = joined[: int(clip_s * 16000)]
        times = []
        for _ in range(cfg.repeats):
            start = time.perf_counter()
            whisper.words(clip)
            times.append(time.perf_counter() - start)
        passes.append({"clip_s": clip_s, "pass_ms": 1e3 * min(times),
                       "ms_per_audio_s": 1e3 * min(times) / clip_s})

    heard = [{"source": "Piper (synthesized)", "reference": text,
              "heard": " ".join(whisper.words(samples))} for text, samples in speech.items()]
    for name, text in SENTENCES.items():
        heard.append({"source": "espeak-ng fixture", "reference": text,
                      "heard": " ".join(whisper.words(to16k(*read_wav(SPEECH_DIR /
                                                                       f"{name}.wav"))))})
    for name, samples in alsa_clips(ctx).items():
        heard.append({"source": "human (ALSA test voice)", "reference": ALSA_CLIPS[name],
                      "heard": " ".join(whisper.words(samples))})
    for row in heard:
        row["wer"] = wer(row["reference"], row["heard"])
    by_source = [{"source": s, "clips": len(rows), "wer": statistics.mean(r["wer"] for r in rows)}
                 for s in dict.fromkeys(r["source"] for r in heard)
                 for rows in [[r for r in heard if r["source"] == s]]]
    return {"memory": memory, "piper": piper, "whisper_passes": passes,
            "transcripts": heard, "wer": by_source}


# ---- sessions against the server ---------------------------------------------------------------
def question_audio(long: bool = False) -> list[bytes]:
    from metronome.audio.voice import Voice

    voice = Voice()
    return [voice.speak(q, RATE_HZ) for q in (LONG_QUESTIONS if long else QUESTIONS)]


def ended_as_a_reply_may(response: dict) -> bool:
    """The model stopped, or its budget ran out (`incomplete`, `max_output_tokens`): never
    cut by the server."""
    details = response.get("status_details") or {}
    return response["status"] == "completed" or (
        response["status"] == "incomplete" and details.get("reason") == "max_output_tokens")


async def voice_session(url: str, arm: str, questions: list[bytes], turns: int, offset_s: float,
                        silence_ms: int, listen: bool = False) -> list[dict]:
    """One session: `turns` questions at real-time pace (1 s quiet before each, 2 s after;
    `listen`: then silence until the reply's audio has played); per turn, when its speech
    ended (the last speech chunk sent), when server VAD stopped it, when the first reply
    output arrived, and the gaps its audio had, played at real time on arrival."""
    await asyncio.sleep(offset_s)
    conn = await Connection.open(url, extensions=False)
    vad = {"type": "server_vad", "silence_duration_ms": silence_ms}
    audio_in = {"turn_detection": vad} | ({"transcription": {"model": "whisper-1"}}
                                          if arm in SPOKEN else {})
    await conn.update({"type": "realtime", "audio": {"input": audio_in}})
    chunk = int(2 * RATE_HZ * CHUNK_S)
    speech_ends, turns_out, errors = [], [], []
    heard = asyncio.Event()  # `listen`: the latest reply's audio has played to its end
    loop = asyncio.get_running_loop()

    async def speak():
        quiet = bytes(2 * RATE_HZ)
        next_at = time.monotonic()
        for turn in range(turns):
            pcm = quiet + questions[turn % len(questions)]
            heard.clear()
            for start in range(0, len(pcm), chunk):
                await conn.append(pcm[start:start + chunk])
                next_at += CHUNK_S
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            speech_ends.append(time.monotonic())
            quiet_chunks = 0
            while quiet_chunks < int(2.0 / CHUNK_S) or (listen and not heard.is_set()):
                await conn.append(bytes(chunk))
                quiet_chunks += 1
                next_at += CHUNK_S
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    sender = asyncio.create_task(speak())
    current: dict | None = None
    stopped_at = None
    output = ("response.output_audio.delta" if arm in SPOKEN
              else "response.output_text.delta")
    try:
        async with asyncio.timeout(turns * (150 if listen else 15) + 30):
            async for event in conn:
                kind, now = event["type"], time.monotonic()
                if kind == "error":
                    errors.append(event["error"].get("code"))
                elif kind == "input_audio_buffer.speech_stopped":
                    stopped_at = now
                elif kind == "response.created":
                    current = {"speech_end": speech_ends[-1] if speech_ends else None,
                               "stopped": stopped_at, "first_output": None,
                               "playback": Playback()}
                elif kind == output and current is not None:
                    if current["first_output"] is None:
                        current["first_output"] = now
                    if kind == "response.output_audio.delta":  # PCM16 mono at RATE_HZ
                        current["playback"].add(now, len(event["delta"]) * 3 / 4 / (2 * RATE_HZ))
                elif kind == "response.done" and current is not None:
                    response = event["response"]
                    current["status"] = response["status"]
                    current["whole"] = ended_as_a_reply_may(response)
                    current["output_tokens"] = (response.get("usage") or {}).get(
                        "output_tokens")
                    turns_out.append(current)
                    ends_in_s = max(0.0, current["playback"].ends_at_s - now)
                    loop.call_later(ends_in_s, heard.set)
                    current = None
                    if len(turns_out) >= turns and sender.done():
                        break
    except TimeoutError:
        pass
    sender.cancel()
    await conn.close()
    rows = []
    for turn in turns_out:
        first, end, stopped = turn["first_output"], turn["speech_end"], turn["stopped"]
        playback = turn["playback"]
        rows.append({"status": turn["status"], "whole": turn["whole"],
                     "errors": len(errors), "codes": errors,
                     "ttfa_ms": None if None in (first, end) else 1e3 * (first - end),
                     "from_stop_ms": None if None in (first, stopped) else
                     1e3 * (first - stopped),
                     "output_tokens": turn["output_tokens"], "played_s": playback.played_s,
                     "gaps": playback.gap_count, "gap_ms": playback.total_gap_ms})
    return rows or [{"status": "none", "whole": False, "errors": len(errors), "codes": errors,
                     "ttfa_ms": None, "from_stop_ms": None, "output_tokens": None,
                     "played_s": 0.0, "gaps": 0, "gap_ms": 0.0}]


def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """The server's `metronome_voice_stage_seconds` (sum, count) by stage, now."""
    totals = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if family.name == "metronome_voice_stage_seconds":
            for sample in family.samples:
                stage = sample.labels.get("stage")
                sums = totals.setdefault(stage, [0.0, 0.0])
                if sample.name.endswith("_sum"):
                    sums[0] = sample.value
                elif sample.name.endswith("_count"):
                    sums[1] = sample.value
    return {stage: (s, c) for stage, (s, c) in totals.items()}


def stage_means_ms(before: dict, after: dict) -> dict[str, float | None]:
    """Each stage's mean time over one run (the difference of two readings): encoder (a
    Whisper pass that ran), lm (a reply frame), voice (a sentence)."""
    means = {}
    for stage in ("encoder", "lm", "voice"):
        s0, c0 = before.get(stage, (0.0, 0.0))
        s1, c1 = after.get(stage, (0.0, 0.0))
        means[stage] = 1e3 * (s1 - s0) / (c1 - c0) if c1 > c0 else None
    return means


def pct(values: list[float | None], q: float) -> float | None:
    """The project's percentile (`metronome.stats`) of the values measured (None: not)."""
    return percentile([v for v in values if v is not None], q)


def sessions(ctx: RunContext, cfg: Config) -> list[dict]:
    long = cfg.answers == "long"
    questions, rows = question_audio(long), []
    with ctx.progress("arms x sessions", len(cfg.arms) * len(cfg.sessions)) as advance:
        for arm in cfg.arms:
            with Server.start(["--model", "bundled", "--admission", "off", "--log-level",
                               "warning", "--whisper-threads", str(cfg.whisper_threads),
                               *ARMS[arm]], timeout_s=300.0, threads=None) as server:
                for n in cfg.sessions:
                    rng = random.Random(n)
                    offsets = sorted(rng.uniform(0, 3.0) for _ in range(n))

                    async def run_all(offsets=offsets, arm=arm, url=server.ws_url):
                        return await asyncio.gather(*(
                            voice_session(url, arm, questions, cfg.turns, off,
                                          cfg.silence_duration_ms, long) for off in offsets))

                    before = stage_totals(server.url)
                    by_session = asyncio.run(run_all())
                    turns = [t for session in by_session for t in session]
                    stage_ms = stage_means_ms(before, stage_totals(server.url))
                    ttfa = [t["ttfa_ms"] for t in turns]
                    replied = [t for t in turns if t["status"] != "none"]
                    tokens = [t["output_tokens"] for t in replied if t["output_tokens"]]
                    rows.append({
                        "arm": arm, "sessions": n, "turns_spoken": n * cfg.turns,
                        "replies": len(replied),
                        "completed": sum(t["status"] == "completed" for t in turns),
                        "whole": sum(t["whole"] for t in turns),
                        "output_tokens_mean": statistics.mean(tokens) if tokens else None,
                        "played_s_mean": statistics.mean(t["played_s"] for t in replied)
                        if replied else None,
                        "gaps_per_reply": statistics.mean(t["gaps"] for t in replied)
                        if replied else None,
                        "replies_with_gaps": sum(t["gaps"] > 0 for t in replied),
                        "gap_ms_p95": pct([t["gap_ms"] for t in replied], 95),
                        "gap_ms_max": max((t["gap_ms"] for t in replied), default=None),
                        "errors": max(t["errors"] for t in turns),
                        "error_codes": dict(Counter(c for session_turns in by_session
                                                    for c in session_turns[0]["codes"])),
                        "ttfa_p50_ms": pct(ttfa, 50), "ttfa_p95_ms": pct(ttfa, 95),
                        "from_stop_p50_ms": pct([t["from_stop_ms"] for t in turns], 50),
                        "from_stop_p95_ms": pct([t["from_stop_ms"] for t in turns], 95),
                        **{f"{stage}_mean_ms": ms for stage, ms in stage_ms.items()}})
                    ctx.log(f"{arm} x {n}: {rows[-1]}")
                    advance()
    return rows


def run(ctx: RunContext, cfg: Config) -> dict:
    ctx.record(**served_facts("bundled"), speech_models="Whisper tiny.en int8 (CTranslate2), "
               "Piper en_US joe medium (ONNX Runtime)", cpu_count=os.cpu_count(),
               apt=shutil.which("apt-get") is not None)
    if cfg.answers not in ("short", "long"):
        raise ValueError(f"answers must be short or long, got {cfg.answers!r}")
    result = {"config": asdict(cfg), "stages": stages(ctx, cfg) if cfg.stages_too else None,
              "sessions": sessions(ctx, cfg)}
    held = [r["sessions"] for r in result["sessions"] if r["arm"] == "voice"
            and r["ttfa_p95_ms"] is not None and r["ttfa_p95_ms"] <= cfg.budget_ms
            and r["replies"] == r["turns_spoken"] and r["whole"] == r["replies"]]
    result["derived"] = derived(f"largest N of voice sessions with p95 time to first audio "
                                f"<= {cfg.budget_ms:g} ms (0: none)", max(held, default=0))
    return REPORT.finish(ctx, result)


REPORT = Report("Voice: the cost of hearing (Whisper) and speaking (Piper)", spec="d", tables=(
    Table("Resident memory of the three models (this process)", "stages.memory"),
    Table("Whisper tiny.en: one pass by clip length", "stages.whisper_passes"),
    Table("Piper: synthesis time per sentence", "stages.piper"),
    Table("Word error rate by source", "stages.wer"),
    Table("Transcripts", "stages.transcripts"),
    Table("Sessions: time to first output (audio for voice, text for embeddings+text)",
          "sessions")),
    plots=(Plot("{stem}.png", "sessions", x="sessions", ys=("ttfa_p50_ms", "ttfa_p95_ms"),
                series="arm"),
           Plot("{stem}_gaps.png", "sessions", x="sessions",
                ys=("gaps_per_reply", "gap_ms_p95", "whole"), series="arm")))
report = REPORT.markdown
