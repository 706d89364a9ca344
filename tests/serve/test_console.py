"""The voice console in headless Chromium against a real server: a fake microphone (a WAV of
Piper asking a question) goes in, the page shows what Whisper heard and receives a spoken
reply, and that reply's audio says what its transcript says. Skips with a message where
Chromium is absent (`make test` installs Debian's chromium).

Chromium is driven over the DevTools protocol (`--remote-debugging-port`): the test reads
`window.consoleState` with `Runtime.evaluate` while the conversation goes on."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

from metronome.audio.whisper import normalise_word
from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.server import ServerThread
from tests.host_speed import UNHURRIED_DEADLINE_FRACTION

pytestmark = pytest.mark.model
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync",
                  "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                  "--autoplay-policy=no-user-gesture-required", "--remote-debugging-port=0"]
QUESTION = "What is the capital of France?"
RATE_HZ = 24000
REPLY_TIMEOUT_S = 40.0


def question_wav(path: Path) -> Path:
    """Piper asking QUESTION: 24 kHz mono PCM16, 1 s of silence before and 2 s after."""
    from metronome.audio.voice import Voice

    speech = Voice().speak(QUESTION, RATE_HZ, exact=True)
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(RATE_HZ)
        wav.writeframes(bytes(2 * RATE_HZ) + speech + bytes(4 * RATE_HZ))
    return path


class Page:
    """The one page of a headless Chromium, evaluated over the DevTools protocol."""

    def __init__(self, profile_dir: Path, timeout_s: float = 30.0) -> None:
        port_file = profile_dir / "DevToolsActivePort"  # Chromium writes its port there
        deadline = time.monotonic() + timeout_s
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline, "Chromium's DevTools port never appeared"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        while True:
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json()
                     if t["type"] == "page"]
            if pages:
                break
            assert time.monotonic() < deadline, "Chromium opened no page"
            time.sleep(0.1)
        self.socket = connect(pages[0]["webSocketDebuggerUrl"], max_size=None)
        self._id = 0

    def evaluate(self, expression: str):
        self._id += 1
        self.socket.send(json.dumps({"id": self._id, "method": "Runtime.evaluate", "params": {
            "expression": expression, "returnByValue": True}}))
        while True:
            reply = json.loads(self.socket.recv(timeout=10))
            if reply.get("id") == self._id:
                break
        assert "exceptionDetails" not in reply["result"], reply["result"]
        return reply["result"]["result"].get("value")

    def state(self) -> dict | None:
        text = self.evaluate("window.consoleState ? JSON.stringify(window.consoleState) : null")
        return None if text is None else json.loads(text)


def answered(state: dict | None) -> bool:
    """Whisper heard a whole turn, and the reply to it is done."""
    return bool(state and any(u["done"] for u in state["userTranscripts"])
                and state["assistantTranscripts"] and state["assistantTranscripts"][-1]["done"])


def words(text: str) -> list[str]:
    return [word for word in map(normalise_word, text.split()) if word]


def heard(audio_base64: list[str]) -> list[str]:
    """What Whisper hears in the reply's audio (PCM16 at 24 kHz)."""
    from metronome.audio.resample import StreamingResampler
    from metronome.audio.whisper import Whisper

    pcm = b"".join(base64.b64decode(delta) for delta in audio_base64)
    samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
    resampler = StreamingResampler(RATE_HZ, 16000)
    samples_16k = np.concatenate([resampler.push(samples),
                                  resampler.push(np.zeros(64, np.float32))])
    return words(" ".join(Whisper().words(samples_16k)))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs "
                    "Debian's chromium package)")
def test_the_console_hears_a_question_and_speaks_its_reply(smollm2, tmp_path):
    wav = question_wav(tmp_path / "question.wav")
    config = ServerConfig(pool_tokens=4096, admission="off",
                          deadline_fraction=UNHURRIED_DEADLINE_FRACTION)
    state = None
    with ServerThread(config, smollm2, load_tokenizer()) as server:
        profile = tmp_path / "chrome"
        browser = subprocess.Popen(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
             f"--use-file-for-fake-audio-capture={wav}%noloop",  # once, then silence
             server.url + "/console?autostart=1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        page = None
        try:
            page = Page(profile)
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while not answered(state := page.state()):
                assert time.monotonic() < deadline, f"no answered turn: {state}"
                time.sleep(0.5)
        finally:
            if page is not None:
                page.socket.close()
            browser.terminate()
            browser.wait(timeout=30)
    user = " ".join(u["text"] for u in state["userTranscripts"] if u["done"])
    assert "capital of france" in " ".join(words(user)), state["userTranscripts"]
    assert state["errors"] == []
    assert state["audioDeltas"] > 0 and state["audioBase64"]
    shown = state["replies"][-1]  # its time to first audio and its gaps, as the page shows
    assert shown["ttfa_ms"] is not None and 0 < shown["ttfa_ms"] < REPLY_TIMEOUT_S * 1e3
    assert shown["gap_count"] >= 0 and shown["output_tokens"] > 0, shown
    said = words(state["assistantTranscripts"][-1]["text"])
    assert said, state["assistantTranscripts"]
    spoken = set(heard(state["audioBase64"]))
    found = [word for word in said if word in spoken]
    assert len(found) >= max(1, 0.6 * len(said)), (said, sorted(spoken))
