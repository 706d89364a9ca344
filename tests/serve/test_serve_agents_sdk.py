"""The OpenAI Agents SDK's realtime runner (`openai-agents`) against `metronome serve`, as a
voice-agent developer would point it at us (`model_config={"url": ...}`): a text turn, an
audio turn, a barge-in, each with no error event and no server event the SDK fails to
validate (it parses every one against OpenAI's schema)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from agents.realtime import RealtimeAgent, RealtimeRunner
from agents.realtime.model_inputs import RealtimeModelSendRawMessage

from metronome.load.speech import SPEECH_DIR, speech_stream
from metronome.serve.protocol import with_extensions

pytestmark = pytest.mark.model
TURN_TIMEOUT_S = 60.0



class Turns:
    """One SDK session, with every event it yields and every problem it reports."""

    def __init__(self, session) -> None:
        self.session = session
        self.events: list = []
        self.problems: list[str] = []

    async def until(self, done) -> list:
        """Events until `done(event)` (the last one included)."""
        seen = []
        async with asyncio.timeout(TURN_TIMEOUT_S):
            async for event in self.session:
                seen.append(event)
                self._note(event)
                if done(event):
                    return seen
        raise AssertionError("the session ended first")

    def _note(self, event) -> None:
        if event.type == "error":
            self.problems.append(f"error event: {event.error}")
        if event.type == "raw_model_event" and event.data.type in ("error", "exception"):
            self.problems.append(f"model {event.data.type}: {event.data}")


def response_done(event) -> bool:
    return event.type == "raw_model_event" and event.data.type == "raw_server_event" and (
        event.data.data.get("type") == "response.done")


def run(server, scenario, caplog, url: str | None = None) -> Turns:
    agent = RealtimeAgent(name="assistant", instructions="You are a helpful assistant. "
                          "Answer briefly.")
    runner = RealtimeRunner(agent, config={"model_settings": {
        "output_modalities": ["text"], "turn_detection": None}})

    async def main() -> Turns:
        session = await runner.run(model_config={"url": url or server.ws_url,
                                                 "api_key": "unused"})
        async with session:
            turns = Turns(session)
            await scenario(turns)
            return turns

    with caplog.at_level(logging.ERROR, logger="openai.agents"):
        turns = asyncio.run(main())
    turns.problems += [r.getMessage() for r in caplog.records
                       if "Failed to validate" in r.getMessage()]
    return turns


def done_responses(events) -> list[dict]:
    return [e.data.data["response"] for e in events if response_done(e)]


def test_a_text_turn_completes_with_no_error(turn_server, caplog):
    async def scenario(turns: Turns):
        await turns.session.send_message("What is the capital of France?")
        turns.events = await turns.until(response_done)

    turns = run(turn_server, scenario, caplog)
    assert not turns.problems, turns.problems
    reply = done_responses(turns.events)[-1]
    assert reply["status"] == "completed"
    assert "Paris" in reply["output"][0]["content"][0]["text"]


def test_an_audio_turn_completes_with_no_error(turn_server, caplog):
    pcm = speech_stream(SPEECH_DIR, 24000, 2.0)

    async def scenario(turns: Turns):
        await turns.session.send_audio(pcm, commit=True)
        await turns.session.model.send_event(
            RealtimeModelSendRawMessage(message={"type": "response.create"}))
        turns.events = await turns.until(response_done)

    turns = run(turn_server, scenario, caplog)
    assert not turns.problems, turns.problems
    # the stand-in audio (embeddings, no Whisper) is noise to the model: its reply runs to
    # the model's stop or to its budget (`incomplete`, `max_output_tokens`), never cut short
    details = done_responses(turns.events)[-1]["status_details"]
    assert details["type"] == "completed" or details["reason"] == "max_output_tokens", details


def test_a_barge_in_cancels_the_response_with_no_error(turn_server, caplog):
    async def scenario(turns: Turns):
        await turns.session.send_message("Tell me a long story about a dragon and a knight.")
        await turns.until(lambda e: e.type == "raw_model_event"
                          and e.data.type == "raw_server_event"
                          and e.data.data.get("type") == "response.created")
        await turns.session.interrupt()
        turns.events = await turns.until(response_done)

    turns = run(turn_server, scenario, caplog)
    assert not turns.problems, turns.problems
    assert done_responses(turns.events)[-1]["status"] in ("cancelled", "completed")


def test_the_check_sees_what_the_sdk_rejects(turn_server, caplog):
    """The criterion can fail: opted in, the server sends `metronome.frame`, which the SDK
    cannot validate (what every client got before the extensions were opt-in)."""
    async def scenario(turns: Turns):
        await turns.session.send_message("Hi")
        turns.events = await turns.until(response_done)

    turns = run(turn_server, scenario, caplog, url=with_extensions(turn_server.ws_url))
    assert any("metronome.frame" in problem or "Failed to validate" in problem
               for problem in turns.problems), turns.problems


def test_a_restored_history_of_20_items_with_no_error(turn_server, caplog):
    """A framework restoring a conversation after a reconnect: 20 items (user and assistant
    in turn) sent at once, then a turn; every item is context (none refused), and the SDK's
    history holds them all."""
    async def scenario(turns: Turns):
        for k in range(20):
            role, kind = ("user", "input_text") if k % 2 == 0 else ("assistant", "output_text")
            await turns.session.model.send_event(RealtimeModelSendRawMessage(message={
                "type": "conversation.item.create", "other_data": {"item": {
                    "type": "message", "role": role,
                    "content": [{"type": kind, "text": f"Message {k} of the history."}]}}}))
        await turns.session.send_message("What is the capital of France?")
        turns.events = await turns.until(response_done)

    turns = run(turn_server, scenario, caplog)
    assert not turns.problems, turns.problems
    added = [e for e in turns.events if e.type == "raw_model_event"
             and e.data.type == "raw_server_event"
             and e.data.data.get("type") == "conversation.item.added"]
    assert len(added) >= 22  # the 20, the question, the reply
    assert done_responses(turns.events)[-1]["status"] == "completed"
