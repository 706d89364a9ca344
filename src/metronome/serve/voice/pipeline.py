"""The voice pipeline, declared in one place: the stages a spoken turn passes, in order.

    audio in ─► hear    Whisper tiny.en (CTranslate2) on the `metronome-audio` thread: a turn's
                        words as it arrives; the same thread prepares every frame's input
                        (the embedding front end's audio, text tokenized)
             ─► think   the beat and the engine (the bounded LM), on the engine thread:
                        not a stage here (`runtime`), the reply's frame
             ─► speak   Piper (ONNX Runtime) on the `metronome-voice` thread: the reply's
                        sentences as PCM16 at 24 kHz
    beside hear: detect  Silero VAD (ONNX Runtime) on the `metronome-vad` thread: turn
                        events, so detecting a turn never delays a frame's input

Each stage is one thread (`stage.Stage`) shared by every session, so each session's stream
of work sees its pieces in order, no model runs on the loop, and the engine's step is never
queued behind a pass. A server without a tokenizer neither hears nor speaks (the words enter
the KV as text, a reply is spoken from text); `--audio-input embeddings` leaves the hear
stage without Whisper, `--no-output-audio` the speak stage without a voice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from metronome.audio.silero import SileroVad
from metronome.audio.voice import Voice
from metronome.audio.whisper import WHISPER_RATE_HZ, WINDOW_S, Whisper
from metronome.observe.metrics import Metrics
from metronome.serve.voice.stage import Stage

OUTPUT_RATE_HZ = 24000  # the reply's audio: pcm16 at OpenAI's one output rate


@dataclass
class VoiceStages:
    hear: Stage[Whisper]  # its model: None when the server does not transcribe
    detect: Stage[SileroVad]  # the network is loaded by the first session that listens
    speak: Stage[Voice]  # its model: None when the server does not speak

    @classmethod
    def start(cls, loop: asyncio.AbstractEventLoop, metrics: Metrics, hears: bool,
              speaks: bool, whisper_threads: int,
              whisper_window_s: float | None = WINDOW_S) -> VoiceStages:
        """The three threads, started now; Whisper (`hears`) and the voice (`speaks`)
        loaded and warmed up on theirs before the first user."""
        return cls(
            Stage("audio", "encoder", loop, metrics,
                  (lambda: _load_whisper(whisper_threads, whisper_window_s)) if hears
                  else None),
            Stage("vad", "vad", loop, metrics, SileroVad, lazy=True),
            Stage("voice", "voice", loop, metrics, _load_voice if speaks else None))

    @property
    def hears(self) -> bool:
        return self.hear.model is not None

    @property
    def speaks(self) -> bool:
        return self.speak.model is not None

    def close(self) -> None:
        for stage in (self.hear, self.detect, self.speak):
            stage.close()


def _load_whisper(cpu_threads: int, window_s: float | None) -> Whisper:
    """On the hear stage: the model, and one pass to set up its kernels (~0.5 s)."""
    whisper = Whisper(cpu_threads, window_s=window_s)
    whisper.words(np.zeros(WHISPER_RATE_HZ, np.float32))
    return whisper


def _load_voice() -> Voice:
    voice = Voice()
    voice.speak("Ready.", OUTPUT_RATE_HZ)  # ONNX Runtime's first run sets up its kernels
    return voice
