"""One stream's voice activity: PCM16 at the stream's rate -> speech started / stopped.

    PCM16 bytes ─decode─► float samples ─resample to 16 kHz (zero phase)─► 512-sample chunks
      ─Silero VAD─► P(speech) per 32 ms chunk ─turn rules─► SpeechStarted / Paused / Stopped

Positions are milliseconds of the input stream from `origin_ms` (where the stream began in
the session's audio): the resampler is zero-phase, so 16 kHz sample `i` is input time
`i / 16 kHz`, and a chunk's span is exact to the sample. Detection lags the audio by at
most one chunk (32 ms) plus the resampler's ~1 ms, and a stop by `silence_duration_ms`.

Owns the stream's carry-over (resampler, the partial chunk, the network's state, the turn
rules' state); `push` runs on the server's VAD thread with the shared `SileroVad`.
"""

from __future__ import annotations

import numpy as np

from metronome.audio.pcm import decode_pcm16_array
from metronome.audio.resample import StreamingResampler
from metronome.audio.silero import CHUNK_SAMPLES, SILERO_RATE_HZ, SileroState, SileroVad
from metronome.audio.turn_detector import TurnDetector, TurnEvent

CHUNK_MS = CHUNK_SAMPLES * 1000 / SILERO_RATE_HZ  # 32 ms


class VadStream:
    def __init__(self, sample_rate_hz: int, threshold: float, silence_duration_ms: float,
                 origin_ms: float = 0.0, pause_ms: float | None = None,
                 max_turn_ms: float | None = None) -> None:
        self.origin_ms = origin_ms
        self.detector = TurnDetector(threshold, silence_duration_ms, pause_ms, max_turn_ms)
        self._resampler = StreamingResampler(sample_rate_hz, SILERO_RATE_HZ)
        self._state = SileroState()
        self._partial = np.zeros(0, dtype=np.float32)  # 16 kHz samples short of a chunk
        self.num_chunks = 0  # chunks judged so far

    def push(self, model: SileroVad, pcm: bytes) -> list[TurnEvent]:
        """More PCM16 audio -> the turn events of every chunk it completes."""
        samples = np.concatenate([self._partial,
                                  self._resampler.push(decode_pcm16_array(pcm))])
        num_whole = len(samples) // CHUNK_SAMPLES * CHUNK_SAMPLES
        events = []
        for chunk in samples[:num_whole].reshape(-1, CHUNK_SAMPLES):
            probability = model.speech_probability(self._state, chunk)
            start_ms = self.origin_ms + self.num_chunks * CHUNK_MS
            self.num_chunks += 1
            event = self.detector.push(probability, start_ms, start_ms + CHUNK_MS)
            if event is not None:
                events.append(event)
        self._partial = samples[num_whole:]
        return events
