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
    """The read bandwidth of `tensors`, measured again whenever asked (a shared machine's
    neighbours move it from one minute to the next: a step is compared with the floor of its
    own time). Given a step's own weights it reads the very pages the step reads: on this
    project's VMs a fresh 1 GiB buffer read anywhere from 30 to 63 GB/s in one minute, by
    where its pages landed, while the weights read at 27-31. Each tensor is summed as float32
    words where its bytes allow (a pure read: a bf16 sum converts every element)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = [_as_words(t) for t in tensors]

    def gbs(self, repeats: int = 5) -> float:
        """Best-of-`repeats` read bandwidth in GB/s (1e9 bytes/s), summed on torch's threads
        (the same threads a step uses), after one untimed pass."""
        nbytes = sum(t.numel() * t.element_size() for t in self._tensors)
        best = float("inf")
        for attempt in range(repeats + 1):
            started = time.perf_counter()
            for t in self._tensors:
                t.sum()
            if attempt:  # the first pass is untimed
                best = min(best, time.perf_counter() - started)
        return nbytes / best / 1e9


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as float32 words where they allow it (contiguous, a whole number of
    words), else `t` itself."""
    nbytes = t.numel() * t.element_size()
    if t.is_contiguous() and nbytes % 4 == 0 and t.element_size() <= 4:
        return t.reshape(-1).view(torch.float32)
    return t


def read_bandwidth_gbs(repeats: int = 5) -> float:
    """Best-of-`repeats` read bandwidth in GB/s of a fresh 1 GiB float32 buffer (the box's,
    measured once: `BandwidthProbe.gbs`)."""
    return BandwidthProbe([torch.ones(BANDWIDTH_BUFFER_BYTES // 4)]).gbs(repeats)


def decode_step_weights(model: LlamaModel) -> list[torch.Tensor]:
    """The tensors a decode step's projections and lm_head read, as the model runs them: the
    few-row kernel's own copy where it runs (bf16 packs one), else the weight itself. The
    bandwidth probe reads these: the very pages the step reads."""
    projections = [p for layer in model.projections for p in
                   (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head_projection]
    return [p.small_weight if p.small is not None else p.weight for p in projections]


def weight_bytes(model: LlamaModel) -> int:
    """Bytes a decode step's projections and lm_head read (the weights, once)."""
    return sum(w.numel() * w.element_size() for w in linear_weights(model))


def decode_floor_ms(model: LlamaModel, sessions: int, resident_tokens: int,
                    bandwidth_gbs: float) -> float:
    """ms to read the weights once and `sessions` x `resident_tokens` tokens of KV once."""
    kv = sessions * resident_tokens * model.config.kv_bytes_per_token(model.dtype)
    return (weight_bytes(model) + kv) / (bandwidth_gbs * 1e9) * 1e3
