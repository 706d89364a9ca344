"""The voice loop: Whisper hears a turn as it arrives, the bounded LM answers, Piper speaks.

Pieces without models (the transcript's agreement rule, sentence cutting, the user message's
framing token for token), then the default server (no flags) end to end: a spoken question
in, its transcript, a spoken answer whose audio Whisper hears back as its transcript.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest
from websockets.sync.client import connect

from metronome.audio.resample import StreamingResampler
from metronome.audio.voice import Sentences, Voice
from metronome.audio.whisper import StreamingTranscript, Whisper, normalise_word
from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.realtime.chat import ChatText, HeardMessage
from metronome.serve.server import ServerThread
from metronome.serve.voice.hearing import Hearing
from tests.host_speed import UNHURRIED_DEADLINE_FRACTION
from tests.served import recv


class ScriptedWhisper:
    """Each pass hears the next of `passes` (word lists), whatever the audio."""

    def __init__(self, passes: list[str]) -> None:
        self.passes = [p.split() for p in passes]
        self.heard_s: list[float] = []

    def words(self, samples_16k: np.ndarray) -> list[str]:
        self.heard_s.append(len(samples_16k) / 16000)
        return self.passes.pop(0)


def second(n: int = 1) -> np.ndarray:
    return np.zeros(16000 * n, np.float32)


def test_words_are_committed_once_two_passes_agree_and_the_final_pass_commits_the_rest():
    whisper = ScriptedWhisper(["what is", "what is the cap", "what is the capital of",
                               "What is the capital of France?"])
    transcript = StreamingTranscript(whisper, 16000)
    assert transcript.push(second(), 1000, final=False) == []  # one pass: nothing agreed
    assert transcript.push(second(), 2000, final=False) == ["what", "is"]
    assert transcript.push(second(), 3000, final=False) == ["the"]  # "cap" was a guess
    assert transcript.push(second(), 4000, final=True) == ["capital", "of", "France?"]
    assert transcript.committed == []  # the next turn starts afresh
    assert whisper.heard_s == [1.0, 2.0, 3.0, 4.0]  # every pass hears the turn so far


def test_a_pass_that_heard_past_the_speech_end_is_the_turns_last():
    """VAD confirms the end 500 ms into silence; if the last pass already heard past the end,
    its words close the turn and the reply need not wait for one more pass."""
    whisper = ScriptedWhisper(["what is", "what is the capital of France?", "unused"])
    transcript = StreamingTranscript(whisper, 16000)
    transcript.push(second(), 1000, final=False)
    assert transcript.push(second(), 2000, final=False) == ["what", "is"]
    # speech ended at 1.7 s: the pass at 2.0 s heard 300 ms past it
    assert transcript.push(second()[:8000], 2500, final=True, speech_end_ms=1700) == [
        "the", "capital", "of", "France?"]
    assert whisper.heard_s == [1.0, 2.0]  # no third pass
    # a pass that stopped short of the end does not count: the last pass runs
    whisper = ScriptedWhisper(["what is", "what is", "what is the capital?"])
    transcript = StreamingTranscript(whisper, 16000)
    transcript.push(second(), 1000, final=False)
    transcript.push(second(), 2000, final=False)
    assert transcript.push(second()[:8000], 2500, final=True, speech_end_ms=1950) == [
        "the", "capital?"]
    assert whisper.heard_s == [1.0, 2.0, 2.5]


def test_before_speech_only_the_last_seconds_are_kept_and_no_pass_runs():
    whisper = ScriptedWhisper(["hello", "hello there"])
    transcript = StreamingTranscript(whisper, 16000)
    for end_s in range(1, 8):  # 7 s of silence before speech: no pass, 3 s kept
        assert transcript.push(second(), end_s * 1000, final=False, speech_from_ms=None) == []
    assert whisper.heard_s == []
    # speech from 6.5 s: the pass hears 6.5 s .. 8 s only
    transcript.push(second(), 8000, final=False, speech_from_ms=6500)
    assert whisper.heard_s == [1.5]
    # a frame with a newer one queued behind it keeps its audio and skips its pass
    assert transcript.push(second(), 9000, final=False, speech_from_ms=6500,
                           pass_now=False) == []
    assert transcript.push(second(), 10000, final=True, speech_from_ms=6500) == [
        "hello", "there"]
    assert whisper.heard_s == [1.5, 3.5]


def test_sentences_go_out_whole_and_in_order():
    sentences = Sentences()
    assert sentences.push("The capital of France") == []
    assert sentences.push(" is Paris. It is on the Sei") == ["The capital of France is Paris."]
    assert sentences.push("ne! Ok. And") == ["It is on the Seine!"]  # "Ok." alone is short
    assert sentences.flush() == ["Ok. And"]
    assert sentences.flush() == []
    # a long first sentence: the first audio need not wait for its end, the rest goes whole
    sentences = Sentences()
    assert sentences.push("The capital of France, as you") == []
    assert sentences.push(" know, is Paris. It is on the Seine. ") == [
        "The capital of France, as you know,", "is Paris. It is on the Seine."]


def test_a_turn_heard_in_pieces_is_the_tokens_of_the_whole_user_message():
    """Words committed frame by frame enter the KV as exactly the tokens of the user message
    a text item with the same words would be."""
    chat = ChatText(load_tokenizer())
    passes = ["What is", "What is the", "What is the capital", "What is the capital of France?"]
    hearing, message = Hearing(ScriptedWhisper(passes), 16000), HeardMessage()
    pcm = (np.zeros(16000, np.int16)).tobytes()
    ids, heard_words = [], []
    for index in range(4):
        heard = hearing.hear(pcm, index == 3, (index + 1) * 1000.0, 0.0, time.monotonic())
        ids += chat.ids(message.piece(heard.words, index == 3))
        heard_words += heard.words
    assert " ".join(heard_words) == "What is the capital of France?"
    assert ids == chat.item_ids("user", "What is the capital of France?")


def test_a_busy_encoder_sheds_partial_passes_but_never_the_last():
    """A frame that waited for the encoder thread (others' passes ahead of it) keeps its audio
    and skips its speculative pass; the turn's last pass runs whatever the wait."""
    whisper = ScriptedWhisper(["what is the capital of France?"])
    hearing = Hearing(whisper, 16000)
    pcm = np.zeros(16000, np.int16).tobytes()
    long_ago = time.monotonic() - 1.0
    shed = hearing.hear(pcm, False, 1000.0, 0.0, long_ago)
    assert shed.words == []
    assert whisper.heard_s == [] and not shed.passed  # shed (the stage metric skips it)
    heard = hearing.hear(pcm, True, 2000.0, 0.0, long_ago)
    assert heard.words
    assert whisper.heard_s == [2.0] and heard.words[-1] == "France?" and heard.passed


def test_a_pause_hears_the_turn_ahead_and_its_commit_then_runs_no_pass():
    """Server VAD heard 200 ms of silence after speech ending at 1.4 s: the turn's last pass
    runs on the frame pushed and the 0.6 s not cut yet, and the commit (speech ended at 1.4 s)
    runs none; a pause heard while the stage is behind, or after a newer frame was cut, is
    shed."""
    whisper = ScriptedWhisper(["what is", "what is the capital of France?", "unused"])
    hearing = Hearing(whisper, 16000)
    pcm = np.zeros(16000, np.int16).tobytes()
    assert hearing.hear(pcm, False, 1000.0, 0.0, time.monotonic()).passed
    rest = np.zeros(9600, np.int16).tobytes()
    assert not hearing.hear_ahead(rest, 1600.0, 0.0, time.monotonic() - 1.0)  # behind
    hearing.latest_cut_ms = 2000.0
    assert not hearing.hear_ahead(rest, 1600.0, 0.0, time.monotonic())  # a newer frame
    hearing.latest_cut_ms = 1000.0
    assert hearing.hear_ahead(rest, 1600.0, 0.0, time.monotonic())
    assert whisper.heard_s == [1.0, 1.6]
    heard = hearing.hear(rest, True, 1600.0, 0.0, time.monotonic(), speech_end_ms=1400.0)
    assert not heard.passed and whisper.heard_s == [1.0, 1.6]
    assert heard.words == "what is the capital of France?".split()


def test_the_default_server_hears_and_speaks():
    """`metronome serve` with no flags: turn mode, server VAD, Whisper, Piper."""
    config = ServerConfig()
    assert (config.mode.value, config.audio_input, config.output_audio, config.server_vad,
            config.idle_timeout_s) == ("turn", "transcribe", True, True, None)


@pytest.mark.model
def test_a_spoken_question_gets_a_spoken_answer(smollm2):
    voice = Voice()
    question = voice.speak("What is the capital of France?", 24000, exact=True)
    silence = bytes(2 * 24000)
    audio = silence + question + silence * 2
    config = ServerConfig(pool_tokens=4096, admission="off",
                          deadline_fraction=UNHURRIED_DEADLINE_FRACTION)
    events = []
    with ServerThread(config, smollm2, load_tokenizer()) as server, connect(
            server.ws_url) as ws:
        assert recv(ws)["type"] == "session.created"
        ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}}))
        updated = recv(ws)
        assert updated["session"]["output_modalities"] == ["audio"]
        assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        step = 4800  # 100 ms chunks at real time, as a microphone sends them
        for start in range(0, len(audio), step):
            ws.send(json.dumps({"type": "input_audio_buffer.append",
                                "audio": base64.b64encode(audio[start:start + step]).decode()}))
            time.sleep(0.1)
        while True:
            event = recv(ws, timeout_s=60)
            events.append(event)
            if event["type"] == "response.done":
                break
    kinds = [e["type"] for e in events]
    assert "error" not in kinds, [e for e in events if e["type"] == "error"]
    completed = next(e for e in events
                     if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert "capital of france" in completed["transcript"].lower()
    deltas = "".join(e["delta"] for e in events
                     if e["type"] == "conversation.item.input_audio_transcription.delta")
    assert deltas == completed["transcript"]  # the deltas add up to the transcript
    assert kinds.index("input_audio_buffer.committed") < kinds.index(
        "conversation.item.input_audio_transcription.completed")
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output_modalities"] == ["audio"]
    transcript = done["output"][0]["content"][0]["transcript"]
    assert transcript
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.output_audio_transcript.delta") == transcript
    reply = b"".join(base64.b64decode(e["delta"]) for e in events
                     if e["type"] == "response.output_audio.delta")
    assert len(reply) > 2 * 24000 * 0.3  # some speech, at 24 kHz
    # the reply's audio says its transcript: Whisper hears most of its words back
    samples = np.frombuffer(reply, "<i2").astype(np.float32) / 32768
    resampler = StreamingResampler(24000, 16000)
    heard = Whisper().words(np.concatenate([resampler.push(samples),
                                            resampler.push(np.zeros(4000, np.float32))]))
    said = {normalise_word(w) for w in transcript.split()} - {""}
    back = {normalise_word(w) for w in heard}
    assert len(said & back) >= max(1, 0.6 * len(said)), (transcript, heard)



class CountingVoice:
    """Speaks each sentence as one 24 kHz sample per character."""

    def speak(self, text: str, to_rate_hz: int) -> bytes:
        return bytes(2 * len(text))


def _speech_run(script) -> list:
    """Run `script(speech)` on a loop where the speak stage is a call_soon: a reply's voice
    (`Speaking`) and the events its reply renders of what was said; `closed` gets the
    reply's cancel reason once its voice is done."""
    from types import SimpleNamespace

    from metronome.serve.realtime.reply import Reply
    from metronome.serve.voice.speaking import Speaking

    events, closed = [], []

    class ToldReply(Reply):
        def on_voice_done(self) -> None:  # (its frame is not answered here: no close)
            closed.append(self.cancel_reason)

    async def main():
        loop = asyncio.get_running_loop()

        def run_model(work, due_s):
            future = loop.create_future()
            loop.call_soon(lambda: future.done() or future.set_result(work(CountingVoice())))
            return future

        stage = SimpleNamespace(run_model=run_model, observe=lambda seconds: None)
        reply = ToldReply(SimpleNamespace(emit=events.append, now_s=lambda: 0.0), "resp_1",
                          "item_1", None)
        reply.voice = voice = Speaking(stage, 24000, reply)
        speech = SimpleNamespace(push=voice.push, cancel=reply.stop_voice,
                                 finish=lambda on_done: voice.finish())
        await script(speech, None)
        for _ in range(5):
            await asyncio.sleep(0)
        return reply

    speech = asyncio.run(main())
    return events, closed, speech


def test_a_reply_is_spoken_sentence_by_sentence_and_closes_after_the_last():
    async def script(speech, on_done):
        speech.push("The capital of France is Paris. It is ")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        speech.push("on the Seine")
        speech.finish(on_done)

    events, closed, speech = _speech_run(script)
    transcripts = [e.delta for e in events if e.type == "response.output_audio_transcript.delta"]
    assert transcripts == ["The capital of France is Paris.", " It is on the Seine"]
    assert speech.spoken == "The capital of France is Paris. It is on the Seine"
    assert speech.audio_bytes == 2 * len("The capital of France is Paris.It is on the Seine")
    assert closed == [None]  # closed once, not cancelled


def test_a_cancel_stops_the_voice_at_once():
    async def script(speech, on_done):
        speech.push("The capital of France is Paris. It is on the Seine. ")
        speech.cancel("turn_detected")  # both sentences are still on the voice thread
        speech.finish(on_done)

    events, closed, speech = _speech_run(script)
    assert events == []  # nothing said after the cancel
    assert closed == ["turn_detected"]
