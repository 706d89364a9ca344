"""Speaking: the bundled Piper voice (en_US joe, medium; ONNX Runtime) and a reply's text cut
into sentences as its tokens arrive.

`Voice.speak` turns one sentence into PCM16 at the session's output rate (Piper speaks at
22.05 kHz, ~0.05-0.08 of real time on 2 cores here; the resampler brings it to 24 kHz). It
runs on the server's voice thread: never on the loop, the engine's thread or the encoder's.

`Sentences` holds a reply's text until a sentence ends (`.`, `!`, `?` or a line break after
some words), so the first sentence is spoken while the model still writes the next.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np

from metronome.audio.carriers import voice_model_path
from metronome.audio.resample import StreamingResampler

_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+|\n+")
MIN_SENTENCE_CHARS = 12  # shorter pieces wait for more (a lone "Dr." or "1." is no sentence)
FIRST_CLAUSE_CHARS = 24  # the reply's first piece may end at a clause from this length on
_CLAUSE_END = re.compile(r"[.!?]+[\"')\]]*\s+|\n+|[,;:]\s+")


class Voice:
    def __init__(self, threads: int = 2) -> None:
        # imported here (ONNX Runtime, espeak-ng): only a server that speaks pays for them
        import json

        import onnxruntime
        from piper import PiperConfig, PiperVoice
        from piper.voice import ESPEAK_DATA_DIR

        path = voice_model_path()
        # Piper's own load takes every core and spins on them between runs: the voice
        # shares the cores with Whisper and the engine, so it takes `threads` and yields
        # (2 threads: 87 ms for a 1.8 s sentence here, 1 thread: 135 ms)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        config = PiperConfig.from_dict(json.loads(path.with_name(path.name + ".json")
                                                  .read_text(encoding="utf-8")))
        self.voice = PiperVoice(config=config, session=onnxruntime.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]),
            espeak_data_dir=Path(ESPEAK_DATA_DIR), download_dir=Path.cwd())
        self.sample_rate_hz: int = self.voice.config.sample_rate
        self._lock = threading.Lock()

    def speak(self, text: str, to_rate_hz: int, exact: bool = False) -> bytes:
        """PCM16 little-endian mono of `text` at `to_rate_hz` (b"" for no speakable text).
        `exact`: without the variation Piper samples (its noise scales 0), so the same text is
        always the same audio (test fixtures; the served voice varies, as speech does)."""
        if not any(ch.isalnum() for ch in text):
            return b""
        from piper import SynthesisConfig

        config = SynthesisConfig(noise_scale=0.0 if exact else None,
                                 noise_w_scale=0.0 if exact else None)
        with self._lock:
            chunks = [chunk.audio_float_array for chunk in self.voice.synthesize(text, config)]
        if not chunks:
            return b""
        samples = np.concatenate(chunks)
        if to_rate_hz != self.sample_rate_hz:
            resampler = StreamingResampler(self.sample_rate_hz, to_rate_hz)
            samples = np.concatenate([resampler.push(samples),
                                      resampler.push(np.zeros(64, np.float32))])
        return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()


class Sentences:
    """A reply's text in, whole sentences out, in order; `flush` gives the rest. The reply's
    first piece may end at a clause (`,` `;` `:`) once it has `FIRST_CLAUSE_CHARS`: the first
    audio need not wait for a long first sentence."""

    def __init__(self) -> None:
        self._held = ""
        self._first = True

    def push(self, text: str) -> list[str]:
        self._held += text
        out = []
        start = 0
        ends = _CLAUSE_END if self._first else _SENTENCE_END
        for match in ends.finditer(self._held):
            piece = self._held[start:match.end()]
            enough = FIRST_CLAUSE_CHARS if self._first and not _SENTENCE_END.fullmatch(
                match.group()) else MIN_SENTENCE_CHARS
            if len(piece.strip()) >= enough:
                out.append(piece.strip())
                start = match.end()
                if self._first:
                    self._first = False
                    self._held = self._held[start:]
                    return out + self.push("")  # the rest, by sentences now
        self._held = self._held[start:]
        return out

    def flush(self) -> list[str]:
        rest, self._held = self._held.strip(), ""
        return [rest] if rest else []
