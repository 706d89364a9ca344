"""The memory floor of a decode step: every weight read once plus every session's resident KV
read once, at this machine's measured read bandwidth. A decode step cannot be faster on a CPU
whose step is memory-bound; how far above it a step runs is what is left to take."""

from __future__ import annotations

import time

import torch

from metronome.bench.engine.flops import linear_weights
from metronome.model.llama import LlamaModel

BANDWIDTH_BUFFER_BYTES = 1 << 30  # far beyond any cache


class BandwidthProbe:
    """The box's read bandwidth, measured again whenever asked (a shared machine's neighbours
    move it from one minute to the next: a step is compared with the floor of its own time).
    Holds its 1 GiB buffer from the first measurement until `close`."""

    def __init__(self) -> None:
        self._data: torch.Tensor | None = None

    def gbs(self, repeats: int = 5) -> float:
        """Best-of-`repeats` read bandwidth in GB/s (1e9 bytes/s): the buffer, float32,
        summed on torch's threads (the same threads a step uses), after one untimed pass."""
        if self._data is None:
            self._data = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, dtype=torch.float32)
        data = self._data
        data.sum()
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - started)
        return BANDWIDTH_BUFFER_BYTES / best / 1e9

    def close(self) -> None:
        self._data = None


def read_bandwidth_gbs(repeats: int = 5) -> float:
    """Best-of-`repeats` read bandwidth in GB/s, measured once (`BandwidthProbe.gbs`)."""
    return BandwidthProbe().gbs(repeats)


def weight_bytes(model: LlamaModel) -> int:
    """Bytes a decode step's projections and lm_head read (the weights, once)."""
    return sum(w.numel() * w.element_size() for w in linear_weights(model))


def decode_floor_ms(model: LlamaModel, sessions: int, resident_tokens: int,
                    bandwidth_gbs: float) -> float:
    """ms to read the weights once and `sessions` x `resident_tokens` tokens of KV once."""
    kv = sessions * resident_tokens * model.config.kv_bytes_per_token(model.dtype)
    return (weight_bytes(model) + kv) / (bandwidth_gbs * 1e9) * 1e3
