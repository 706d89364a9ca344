"""The voice-agent clients, each with its *default* audio configuration, against the server
started with no flags (`metronome serve`: turn mode, server VAD, Whisper, Piper): the official
`openai` SDK, the OpenAI Agents SDK's `RealtimeRunner` and LiveKit's OpenAI realtime plugin.
Each speaks one question asking for a long answer, at real-time pace, and must get a reply of
more than 100 tokens (the server's default ceiling is 256), all of it spoken: its audio, and
a transcript that is the whole reply, with zero error events (and nothing its own schema
check rejects). A reply ends at the model's stop or its budget (`incomplete`,
`max_output_tokens`, OpenAI's reason), never at a deadline."""

from __future__ import annotations

import asyncio
import base64
import logging

import aiohttp
import numpy as np
import pytest
from agents.realtime import RealtimeAgent, RealtimeRunner
from livekit import rtc
from livekit.plugins.openai.realtime import RealtimeModel
from openai import AsyncOpenAI

from metronome.audio.voice import Voice
from metronome.bench.presets.voice import ended_as_a_reply_may
from metronome.serve.config import ServerConfig
from tests.served import served

pytestmark = pytest.mark.model
RATE_HZ = 24000
CHUNK_BYTES = 2 * RATE_HZ // 10  # 100 ms
TIMEOUT_S = 150.0
LONG_REPLY_TOKENS = 100  # a reply longer than this: far past the old 16-token one
SPOKEN_CHARS_PER_S = 25.0  # faster than Piper ever speaks (15-20): audio at least this long


def long_reply_tokens(text: str) -> int:
    from metronome.model.weights import load_tokenizer

    return len(load_tokenizer().encode(text))


@pytest.fixture(scope="module")
def url():
    with served(ServerConfig()) as running:  # no flags: every default
        yield running


@pytest.fixture(scope="module")
def question() -> bytes:
    """1 s quiet, the spoken question, 1.5 s quiet (server VAD ends the turn in it)."""
    speech = Voice().speak("Tell me about Paris in detail.", RATE_HZ, exact=True)
    return bytes(2 * RATE_HZ) + speech + bytes(3 * RATE_HZ)


def chunks(pcm: bytes):
    for start in range(0, len(pcm), CHUNK_BYTES):
        yield pcm[start:start + CHUNK_BYTES]


def test_the_openai_sdk_with_its_defaults_hears_a_spoken_answer(url, question):
    async def main() -> list:
        client = AsyncOpenAI(api_key="unused", websocket_base_url=url.replace("http", "ws")
                             + "/v1")
        events = []
        async with client.realtime.connect(model="metronome") as conn:
            assert (await conn.recv()).type == "session.created"
            for chunk in chunks(question):  # no session.update: the defaults
                await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())
                await asyncio.sleep(0.1)
            async with asyncio.timeout(TIMEOUT_S):
                while (event := await conn.recv()).type != "response.done":
                    events.append(event)
            events.append(event)
        return events

    events = asyncio.run(main())
    kinds = [e.type for e in events]
    assert "error" not in kinds, [e for e in events if e.type == "error"]
    audio = b"".join(base64.b64decode(e.delta) for e in events
                     if e.type == "response.output_audio.delta")
    transcript = "".join(e.delta for e in events
                         if e.type == "response.output_audio_transcript.delta")
    done = events[-1].response
    assert ended_as_a_reply_may(done.model_dump()), done
    assert done.usage.output_tokens > LONG_REPLY_TOKENS, done.usage
    assert done.output[0].content[0].transcript == transcript  # all of it was spoken
    assert len(audio) / (2 * RATE_HZ) > len(transcript) / SPOKEN_CHARS_PER_S


def test_the_agents_sdk_with_its_defaults_hears_a_spoken_answer(url, question, caplog):
    agent = RealtimeAgent(name="assistant", instructions="Answer briefly.")
    runner = RealtimeRunner(agent)  # the SDK's default audio settings

    async def main():
        session = await runner.run(model_config={"url": url.replace("http", "ws")
                                                 + "/v1/realtime", "api_key": "unused"})
        raw, problems, audio_events = [], [], 0
        async with session:
            async def speak():
                for chunk in chunks(question):
                    await session.send_audio(chunk)
                    await asyncio.sleep(0.1)

            sender = asyncio.create_task(speak())
            async with asyncio.timeout(TIMEOUT_S):
                async for event in session:
                    if event.type == "audio":
                        audio_events += 1
                    if event.type == "error":
                        problems.append(f"error event: {event.error}")
                    if event.type == "raw_model_event":
                        data = event.data
                        if data.type in ("error", "exception"):
                            problems.append(f"model {data.type}: {data}")
                        if data.type == "raw_server_event":
                            raw.append(data.data)
                            if data.data.get("type") == "response.done":
                                break
            await sender
        return raw, problems, audio_events

    with caplog.at_level(logging.ERROR, logger="openai.agents"):
        raw, problems, audio_events = asyncio.run(main())
    problems += [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not problems, problems
    kinds = [e.get("type") for e in raw]
    assert audio_events > 0
    heard = [e for e in raw
             if e.get("type") == "conversation.item.input_audio_transcription.completed"]
    assert heard and "paris" in heard[0]["transcript"].lower()  # the SDK asks for it
    transcript = "".join(e["delta"] for e in raw
                         if e.get("type") == "response.output_audio_transcript.delta")
    done = raw[-1]["response"]
    assert ended_as_a_reply_may(done), kinds
    assert done["usage"]["output_tokens"] > LONG_REPLY_TOKENS, done["usage"]
    assert done["output"][0]["content"][0]["transcript"] == transcript


def test_livekit_with_its_defaults_hears_a_spoken_answer(url, question, caplog):
    errors: list[str] = []

    async def main():
        async with aiohttp.ClientSession() as http:
            model = RealtimeModel(base_url=f"{url}/v1", api_key="unused", http_session=http)
            session = model.session()
            session.on("error", lambda event: errors.append(repr(event.error)))
            replies = asyncio.Queue()
            session.on("generation_created", replies.put_nowait)
            try:
                samples = np.frombuffer(question, dtype=np.int16)
                step = RATE_HZ // 10
                for start in range(0, len(samples) - step + 1, step):
                    chunk = samples[start:start + step]
                    session.push_audio(rtc.AudioFrame(chunk.tobytes(), RATE_HZ, 1, len(chunk)))
                    await asyncio.sleep(0.1)
                generation = await asyncio.wait_for(replies.get(), TIMEOUT_S)
                pieces, frames = [], [0]

                async def read_text(stream):
                    async for piece in stream:
                        pieces.append(str(piece))

                async def read_audio(stream):
                    async for _ in stream:
                        frames[0] += 1

                async with asyncio.timeout(TIMEOUT_S):
                    async for message in generation.message_stream:
                        await asyncio.gather(read_text(message.text_stream),
                                             read_audio(message.audio_stream))
                text, frames = "".join(pieces), frames[0]
                return text, frames
            finally:
                await session.aclose()

    with caplog.at_level(logging.WARNING, logger="livekit.agents"):
        text, frames = asyncio.run(main())
    errors += [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    # the plugin reports a reply that ran to its budget (`incomplete`, `max_output_tokens`)
    # as an error, as it does OpenAI's; nothing else may go wrong
    assert not [e for e in errors if "response incomplete: max_output_tokens" not in e], errors
    assert frames > 0  # the reply spoken
    assert long_reply_tokens(text) > LONG_REPLY_TOKENS, text  # and its transcript: long
