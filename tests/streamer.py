"""The well-behaved client of the hostile-input suites: speech at real-time pace."""

from __future__ import annotations

import base64
import json
import threading
import time

from websockets.sync.client import connect

from metronome.load.speech import SPEECH_DIR, speech_stream
from metronome.serve.protocol import with_extensions
from tests import served

REPLY_TIMEOUT_S = 3.0  # answers take milliseconds


def recv(ws, timeout_s: float = REPLY_TIMEOUT_S) -> dict:
    """`served.recv` (checked against OpenAI's schema), with this module's short timeout."""
    return served.recv(ws, timeout_s)


class SpeechStreamer:
    """Speech at real-time pace in 100 ms chunks, from a sender thread, while a receiver
    thread collects every frame result. `connect_options` go to `websockets` (headers or
    subprotocols for a key)."""

    CHUNK_S = 0.1

    def __init__(self, url: str, seconds: float = 120.0, **connect_options) -> None:
        self.ws = connect(with_extensions(url), **connect_options)  # metronome.frame too
        recv(self.ws)
        self.pcm = speech_stream(SPEECH_DIR, 24000, seconds)
        self.frames: list[dict] = []
        self.errors: list[dict] = []
        self.sent_bytes = 0
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send, daemon=True)
        self._receiver = threading.Thread(target=self._receive, daemon=True)

    def start(self) -> None:
        self._sender.start()
        self._receiver.start()

    def _send(self) -> None:
        chunk_bytes = round(24000 * self.CHUNK_S) * 2
        started = time.monotonic()
        for k, offset in enumerate(range(0, len(self.pcm), chunk_bytes)):
            time.sleep(max(0.0, started + (k + 1) * self.CHUNK_S - time.monotonic()))
            if self._stop.is_set():
                return
            chunk = self.pcm[offset: offset + chunk_bytes]
            self.ws.send(json.dumps({"type": "input_audio_buffer.append",
                                     "audio": base64.b64encode(chunk).decode()}))
            self.sent_bytes += len(chunk)

    def _receive(self) -> None:
        for message in self.ws:
            event = json.loads(message)
            if event["type"] == "metronome.frame":
                self.frames.append(event["frame"])
            elif event["type"] == "error":
                self.errors.append(event["error"])

    @property
    def late_frames(self) -> list[dict]:
        return [f for f in self.frames if f["status"] != "ok" or not f["deadline_met"]]

    def stop(self) -> int:
        """Stop sending, wait for the last results; returns the frames sent."""
        self._stop.set()
        self._sender.join()
        sent_frames = self.sent_bytes // 48000
        deadline = time.monotonic() + 5
        while len(self.frames) < sent_frames and time.monotonic() < deadline:
            time.sleep(0.05)
        self.ws.close()
        self._receiver.join(timeout=5)
        return sent_frames
