"""Streaming sample-rate conversion: audio at `from_hz`, fed in any chunking, -> `to_hz`.

Output sample `j` is the band-limited signal at time `j / to_hz` exactly (zero phase: a
windowed sinc centred on the input position `j * from_hz / to_hz`), so a position in the
output stream maps to the same time in the input stream. Pushing audio in any chunking
yields what resampling the whole input at once does: an output sample is made only once
every input sample under its kernel has arrived (latency: the kernel's half-width, about
1 ms here). Before the stream's start the input is taken as silence.

NumPy only (no torch): it runs on the server's VAD thread, beside the engine's threads.
"""

from __future__ import annotations

import math

import numpy as np

ZERO_CROSSINGS = 16  # of the sinc on each side of its centre: the kernel's half-width


class StreamingResampler:
    def __init__(self, from_hz: int, to_hz: int) -> None:
        if from_hz <= 0 or to_hz <= 0:
            raise ValueError(f"sample rates must be positive, got {from_hz} -> {to_hz} Hz")
        common = math.gcd(from_hz, to_hz)
        # output j sits at input position j * step_num / step_den (in input samples)
        self._step_num, self._step_den = from_hz // common, to_hz // common
        self.identity = from_hz == to_hz
        cutoff = min(1.0, to_hz / from_hz)  # of the input's Nyquist: below both Nyquists
        self._half_taps = math.ceil(ZERO_CROSSINGS / cutoff)
        offsets = np.arange(-self._half_taps + 1, self._half_taps + 1)  # (taps,)
        phases = np.arange(self._step_den)[:, None] / self._step_den  # (step_den, 1)
        distance = offsets[None, :] - phases  # input samples from the output's time
        window = np.cos(np.pi * distance / (2 * self._half_taps)) ** 2  # Hann, zero at edges
        self._kernels = (cutoff * np.sinc(cutoff * distance) * window).astype(np.float32)
        self._offsets = offsets
        # input samples held, from absolute input index `_held_from`; silence before 0
        self._held = np.zeros(self._half_taps, dtype=np.float32)
        self._held_from = -self._half_taps
        self._received = 0  # input samples pushed so far
        self.produced = 0  # output samples made so far: the next one's index

    def push(self, samples: np.ndarray) -> np.ndarray:
        """More input (float32, any length) -> every output sample it completes."""
        if self.identity:
            self.produced += len(samples)
            return samples.astype(np.float32, copy=False)
        self._held = np.concatenate([self._held, samples.astype(np.float32, copy=False)])
        self._received += len(samples)
        # output j needs input up to floor(j * num / den) + half_taps
        last_input = self._received - 1 - self._half_taps
        if last_input < 0:
            return np.zeros(0, dtype=np.float32)
        end = ((last_input + 1) * self._step_den - 1) // self._step_num + 1  # [produced, end)
        out_ids = np.arange(self.produced, end)
        centres = (out_ids * self._step_num) // self._step_den
        phases = (out_ids * self._step_num) % self._step_den
        taps = centres[:, None] + self._offsets[None, :] - self._held_from  # (n, taps)
        out = np.einsum("nt,nt->n", self._held[taps], self._kernels[phases])
        self.produced = end
        keep_from = (end * self._step_num) // self._step_den - self._half_taps + 1
        self._held = self._held[keep_from - self._held_from:]
        self._held_from = keep_from
        return out.astype(np.float32, copy=False)
