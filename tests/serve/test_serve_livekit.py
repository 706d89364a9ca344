"""LiveKit Agents' OpenAI realtime plugin (`livekit-plugins-openai`) against `metronome serve`,
driven without a LiveKit room, with the plugin's defaults (semantic VAD included) and only
`base_url` and text output set: a text reply, pushed audio, an interruption, each with no
`error` the plugin reports."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import numpy as np
import pytest
from livekit import rtc
from livekit.agents import llm
from livekit.plugins.openai.realtime import RealtimeModel

from metronome.load.speech import SPEECH_DIR, speech_stream

pytestmark = pytest.mark.model
REPLY_TIMEOUT_S = 60.0



async def reply_text(generation: llm.GenerationCreatedEvent) -> str:
    text = ""
    async with asyncio.timeout(REPLY_TIMEOUT_S):
        async for message in generation.message_stream:
            async for chunk in message.text_stream:
                text += str(chunk)
    return text


def run(server, scenario, caplog):
    """`scenario(session)` on one plugin session; every error it reports, and its result."""
    errors: list[str] = []

    async def main():
        async with aiohttp.ClientSession() as http:
            model = RealtimeModel(base_url=f"{server.url}/v1", api_key="unused",
                                  modalities=["text"], http_session=http)
            session = model.session()
            session.on("error", lambda event: errors.append(repr(event.error)))
            try:
                return await scenario(session)
            finally:
                await session.aclose()

    with caplog.at_level(logging.WARNING, logger="livekit.agents"):
        result = asyncio.run(main())
    errors += [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return result, errors


def test_a_text_reply_with_no_error(turn_server, caplog):
    async def scenario(session):
        await session.update_instructions("You are a helpful assistant. Answer briefly.")
        chat = session.chat_ctx.copy()
        chat.add_message(role="user", content="What is the capital of France?")
        await session.update_chat_ctx(chat)
        generation = await asyncio.wait_for(session.generate_reply(), REPLY_TIMEOUT_S)
        return await reply_text(generation)

    text, errors = run(turn_server, scenario, caplog)
    assert not errors, errors
    assert "Paris" in text


def frames_of(pcm: bytes, rate_hz: int = 24000, chunk_s: float = 0.1):
    samples = np.frombuffer(pcm, dtype=np.int16)
    step = int(rate_hz * chunk_s)
    for start in range(0, len(samples) - step + 1, step):
        chunk = samples[start:start + step]
        yield rtc.AudioFrame(chunk.tobytes(), rate_hz, 1, len(chunk))


def test_pushed_audio_gets_a_reply_with_no_error(turn_server, caplog):
    pcm = speech_stream(SPEECH_DIR, 24000, 2.0) + bytes(2 * 24000)  # speech, then 1 s quiet

    async def scenario(session):
        replies = asyncio.Queue()
        session.on("generation_created", replies.put_nowait)
        for frame in frames_of(pcm):
            session.push_audio(frame)
            await asyncio.sleep(0.1)  # real time: server VAD hears the turn end
        generation = await asyncio.wait_for(replies.get(), REPLY_TIMEOUT_S)
        return await reply_text(generation)

    text, errors = run(turn_server, scenario, caplog)
    # the stand-in audio (embeddings, no Whisper) is noise to the model, which rambles on to
    # its budget: the plugin reports a reply cut there (`incomplete`, `max_output_tokens`)
    # as an error, as it does OpenAI's; nothing else may go wrong
    assert not [e for e in errors if "response incomplete: max_output_tokens" not in e], errors
    assert text  # a reply to the turn server VAD (asked for as semantic VAD) detected


def test_an_interruption_with_no_error(turn_server, caplog):
    async def scenario(session):
        chat = session.chat_ctx.copy()
        chat.add_message(role="user", content="Tell me a long story about a dragon.")
        await session.update_chat_ctx(chat)
        generation = await asyncio.wait_for(session.generate_reply(), REPLY_TIMEOUT_S)
        session.interrupt()
        return await reply_text(generation)

    _, errors = run(turn_server, scenario, caplog)
    assert not errors, errors


def history(count: int = 20) -> list[tuple[str, str]]:
    """A conversation of `count` messages, user and assistant in turn."""
    return [("user", f"Fact {k}: the box number {k} holds {k * 3} red marbles.") if k % 2 == 0
            else ("assistant", f"Noted: box {k - 1} holds {(k - 1) * 3} red marbles.")
            for k in range(count)]


def test_an_initial_chat_context_of_20_messages_with_no_error(turn_server, caplog):
    """An agent that starts with a chat context of 20 messages: the plugin sends them all at
    once (conversation.item.create each) and waits for each to be added; they are context,
    so none is refused (before: past 4 unanswered frames each was `too_many_pending_frames`)."""
    async def scenario(session):
        chat = session.chat_ctx.copy()
        for role, text in history():
            chat.add_message(role=role, content=text)
        chat.add_message(role="user", content="What is the capital of France?")
        await session.update_chat_ctx(chat)
        generation = await asyncio.wait_for(session.generate_reply(), REPLY_TIMEOUT_S)
        return len(session.chat_ctx.items), await reply_text(generation)

    (items, text), errors = run(turn_server, scenario, caplog)
    assert not errors, errors
    assert items >= 21 and text
