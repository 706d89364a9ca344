"""`metronome bench talkers`: nobody loses their words. Live microphones (100 ms chunks at real
time) against `metronome serve` with its defaults (the voice agent), in the scenarios where
speech is long or never pauses (issue 52):

* **a monologue alone**: 1 s of quiet, `monologue_s` seconds of speech without a pause (Piper
  speaking a paragraph, sentences joined by 150 ms, under server VAD's 500 ms), then quiet
  until the reply has been answered. Per length: chunks the server refused, the turn's
  transcript (`conversation.item.input_audio_transcription.completed`) and its word error
  against the text, the reply's status, time to first audio from the end of speech, and what
  hearing it cost (the server's Whisper passes, from /metrics: encoder seconds per second
  of speech, passes, mean pass).
* **a neighbour beside non-stop talkers**: a session asking three short questions (the voice
  bench's), alone and beside 1 and 2 talkers that loop the paragraph at real time for the
  whole run and never pause. Per case: the neighbour's refused chunks, replies completed, time
  to first audio p50 / p95; the talkers' refused chunks and the words they were heard saying
  (transcription deltas).

Each arm is one server (the flags of `ARMS`), every scenario in it one after another. Derived
number: chunks refused to clients sending at real time, over the `voice` arm (the goal: 0).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass

from metronome.bench.presets import Knobs, knob
from metronome.bench.presets.voice import (
    CHUNK_S,
    RATE_HZ,
    VOICE,
    ended_as_a_reply_may,
    pct,
    question_audio,
    stage_totals,
    voice_session,
    wer,
)
from metronome.bench.server import Server, served_facts
from metronome.load.client import Connection
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "talkers"
# plain prose, ~70 s spoken by Piper: what a person explaining something says in one breath
PARAGRAPH = [
    "I want to tell you about the trip we took last summer to the mountains in the north.",
    "We left early on a Saturday morning and drove for almost six hours before we stopped.",
    "The road climbed through forests and small villages where people sold fruit and bread.",
    "When we reached the lake the water was so clear that we could see the stones below.",
    "My brother wanted to swim right away but the water was much colder than he expected.",
    "In the evening we cooked dinner on a small fire and watched the stars come out.",
    "The next day we walked up to the old stone bridge that crosses the river gorge.",
    "It took us three hours to get there and the path was steep and narrow in places.",
    "At the top there was a little house where an old man sold tea and honey cakes.",
    "He told us that the bridge was built more than four hundred years ago by farmers.",
    "On the way down it started to rain and we had to shelter under a large rock.",
    "We finally got back to the car just before dark, tired and wet but very happy.",
    "I would like to go back there next year and stay for a whole week this time.",
    "Can you suggest a few things we should bring with us and what we should plan?",
]
JOIN_S = 0.15  # the breath between sentences: under server VAD's 500 ms, so never a turn end
# the serve flags of each arm (after the launcher's `--model bundled --log-level warning`)
ARMS = {
    "voice": VOICE,
}


@dataclass
class Config(Knobs):
    monologue_s: tuple[float, ...] = knob((8.0, 15.0, 60.0), "monologue lengths, alone")
    talkers: tuple[int, ...] = knob((0, 1, 2), "non-stop talkers beside the neighbour")
    turns: int = knob(3, "questions the neighbour asks")
    arms: tuple[str, ...] = knob(("voice",), " | ".join(ARMS))
    talker_turn_limit_s: float = knob(0.0, "the server's --max-turn-s for the talkers "
                                      "(0: its default, 120 s): a talker's turn is "
                                      "committed, its words told and answered, at the limit")

    SMOKE = dict(monologue_s=(8.0,), talkers=(0, 1), turns=1)


def speech(seconds: float) -> tuple[bytes, str]:
    """PCM16 at RATE_HZ of the paragraph's first sentences, at least `seconds` long (looped
    when it is shorter), joined by `JOIN_S` breaths; and the text they say."""
    from metronome.audio.voice import Voice

    voice, pcm, said = Voice(), b"", []
    breath = bytes(2 * int(RATE_HZ * JOIN_S))
    k = 0
    while len(pcm) < 2 * RATE_HZ * seconds:
        sentence = PARAGRAPH[k % len(PARAGRAPH)]
        pcm += (breath if pcm else b"") + voice.speak(sentence, RATE_HZ, exact=True)
        said.append(sentence)
        k += 1
    return pcm, " ".join(said)


async def stream_at_real_time(conn: Connection, pcm: bytes, stop: asyncio.Event | None = None,
                  loop_audio: bool = False) -> None:
    """`pcm` at real time in CHUNK_S chunks (looped while `stop` is not set)."""
    chunk = int(2 * RATE_HZ * CHUNK_S)
    next_at = time.monotonic()
    start = 0
    while True:
        if start >= len(pcm):
            if not loop_audio:
                return
            start = 0
        if stop is not None and stop.is_set():
            return
        await conn.append(pcm[start:start + chunk])
        start += chunk
        next_at += CHUNK_S
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


async def open_voice(url: str, extensions: bool = False) -> Connection:
    conn = await Connection.open(url, extensions=extensions)
    await conn.update({"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "server_vad"}, "transcription": {"model": "whisper-1"}}}})
    return conn


async def monologue(url: str, seconds: float) -> dict:
    """One person, alone, speaking `seconds` without a pause; quiet until the reply is done."""
    pcm, text = speech(seconds)
    conn = await open_voice(url)
    quiet = bytes(2 * RATE_HZ)
    errors: Counter = Counter()
    out: dict = {"speech_s": round(len(pcm) / (2 * RATE_HZ), 1), "transcript": None,
                 "status": None, "whole": False, "first_audio_s": None}
    ended = asyncio.Event()

    async def speak() -> None:
        await stream_at_real_time(conn, quiet + pcm)
        out["speech_end"] = time.monotonic()
        while not ended.is_set():
            await stream_at_real_time(conn, bytes(int(2 * RATE_HZ * CHUNK_S)))

    sender = asyncio.create_task(speak())
    try:
        async with asyncio.timeout(seconds + 120):
            async for event in conn:
                kind = event["type"]
                if kind == "error":
                    errors[event["error"].get("code")] += 1
                elif kind == "conversation.item.input_audio_transcription.completed":
                    out["transcript"] = (out["transcript"] or "") + " " + event["transcript"]
                elif kind == "response.output_audio.delta" and out["first_audio_s"] is None:
                    out["first_audio_s"] = time.monotonic()
                elif kind == "response.done":
                    out["status"] = event["response"]["status"]
                    out["whole"] = ended_as_a_reply_may(event["response"])
                    if "speech_end" in out:
                        break
    except TimeoutError:
        pass
    ended.set()
    sender.cancel()
    await conn.close()
    end, first = out.pop("speech_end", None), out.pop("first_audio_s")
    heard = (out["transcript"] or "").strip()
    return {**out, "transcript": heard, "wer": wer(text, heard),
            "refused_chunks": sum(errors.values()), "error_codes": dict(errors),
            "ttfa_ms": None if None in (first, end) or first < end else 1e3 * (first - end)}


async def talker(url: str, pcm: bytes, stop: asyncio.Event) -> dict:
    """Speech looped at real time until `stop`, never a pause: what it was refused and heard
    (the tokens its heard words put in its KV, from its `metronome.frame` events, and the words
    it is told it said, which come at a turn's commit: at the turn limit)."""
    conn = await open_voice(url, extensions=True)
    errors: Counter = Counter()
    words = tokens = behind = 0

    async def read() -> None:
        nonlocal words, tokens, behind
        async for event in conn:
            if event["type"] == "error":
                errors[event["error"].get("code")] += 1
            elif event["type"] == "conversation.item.input_audio_transcription.delta":
                words += len(event["delta"].split())
            elif event["type"] == "metronome.frame" and event["response_id"] is None:
                tokens += event["frame"]["num_input_tokens"]
            elif event["type"] == "metronome.input.behind":
                behind += 1

    reader = asyncio.create_task(read())
    await stream_at_real_time(conn, pcm, stop, loop_audio=True)
    await asyncio.sleep(1.0)
    reader.cancel()
    await conn.close()
    return {"refused_chunks": sum(errors.values()), "error_codes": dict(errors),
            "words_heard": words, "tokens_heard": tokens, "behind_notices": behind}


async def beside(url: str, talkers: int, turns: int, pcm: bytes,
                 questions: list[bytes]) -> dict:
    stop = asyncio.Event()
    loud = [asyncio.create_task(talker(url, pcm, stop)) for _ in range(talkers)]
    await asyncio.sleep(3.0 if talkers else 0.0)  # the talkers are under way
    rows = await voice_session(url, "voice", questions, turns, 0.0, 500)
    stop.set()
    others = await asyncio.gather(*loud)
    ttfa = [r["ttfa_ms"] for r in rows]
    return {"talkers": talkers, "replies": sum(r["status"] != "none" for r in rows),
            "completed": sum(r["whole"] for r in rows),
            "refused_chunks": rows[0]["errors"],
            "error_codes": dict(Counter(rows[0]["codes"])),
            "ttfa_p50_ms": pct(ttfa, 50), "ttfa_p95_ms": pct(ttfa, 95),
            "talkers_refused_chunks": sum(o["refused_chunks"] for o in others),
            "talkers_error_codes": dict(sum((Counter(o["error_codes"]) for o in others),
                                            Counter())),
            "talkers_tokens_heard": [o["tokens_heard"] for o in others],
            "talkers_words_told": [o["words_heard"] for o in others],
            "talkers_behind_notices": sum(o["behind_notices"] for o in others)}


def run(ctx: RunContext, cfg: Config) -> dict:
    ctx.record(**served_facts("bundled"))
    loop_pcm, _ = speech(60.0)
    questions = question_audio()
    monologues, neighbours = [], []
    steps = len(cfg.arms) * (len(cfg.monologue_s) + len(cfg.talkers))
    limit = (["--max-turn-s", str(cfg.talker_turn_limit_s)] if cfg.talker_turn_limit_s
             else [])
    with ctx.progress("arms x scenarios", steps) as advance:
        for arm in cfg.arms:
            serve = ["--model", "bundled", "--log-level", "warning", *ARMS[arm]]
            with Server.start(serve, timeout_s=300.0, threads=None) as server:
                for seconds in cfg.monologue_s:
                    before = stage_totals(server.url).get("encoder", (0.0, 0.0))
                    row = {"arm": arm, **asyncio.run(monologue(server.ws_url, seconds))}
                    after = stage_totals(server.url).get("encoder", (0.0, 0.0))
                    passes = after[1] - before[1]
                    row |= {"whisper_passes": int(passes),
                            "encoder_s_per_speech_s": round((after[0] - before[0])
                                                            / row["speech_s"], 3),
                            "pass_mean_ms": round(1e3 * (after[0] - before[0]) / passes)
                            if passes else None}
                    monologues.append(row)
                    ctx.log(f"{arm}, a {seconds:g} s monologue: {row}")
                    advance()
            with Server.start([*serve, *limit], timeout_s=300.0, threads=None) as server:
                for n in cfg.talkers:
                    row = {"arm": arm, **asyncio.run(beside(server.ws_url, n, cfg.turns,
                                                            loop_pcm, questions))}
                    neighbours.append(row)
                    ctx.log(f"{arm}, the neighbour beside {n} talkers: {row}")
                    advance()
    _alone_ratio(neighbours)
    result = {"config": asdict(cfg), "monologues": monologues, "neighbours": neighbours}
    refused = sum(r["refused_chunks"] for r in monologues + neighbours if r["arm"] == "voice")
    refused += sum(r["talkers_refused_chunks"] for r in neighbours if r["arm"] == "voice")
    result["derived"] = derived("audio chunks refused to clients sending at real time "
                                "(voice arm; goal 0)", refused)
    return REPORT.finish(ctx, result)


def _alone_ratio(rows: list[dict]) -> None:
    """Each neighbour row's p50 TTFA over its arm's alone value (the goal: <= 1.5)."""
    alone = {r["arm"]: r["ttfa_p50_ms"] for r in rows if r["talkers"] == 0}
    for r in rows:
        base = alone.get(r["arm"])
        r["ttfa_p50_vs_alone"] = (None if not base or r["ttfa_p50_ms"] is None
                                  else round(r["ttfa_p50_ms"] / base, 2))


REPORT = Report("Talkers: long utterances and speech that never pauses", spec="d", tables=(
    Table("A monologue alone", "monologues"),
    Table("The neighbour beside non-stop talkers", "neighbours")),
    plots=(Plot("{stem}.png", "neighbours", x="talkers", ys=("ttfa_p50_ms", "ttfa_p95_ms"),
                series="arm"),))
report = REPORT.markdown
