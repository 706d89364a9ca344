"""The KV budget of a capacity plan: the model's shapes (no weights loaded), its bytes per KV
token and per weight, and the pool in blocks from tokens, bytes, or a GPU's memory.

A GPU budget follows vLLM's rule: the engine may use `utilization` of the device's memory
(vLLM's `gpu_memory_utilization`, 0.9 by default); the weights and a reserve for activations
come out of that, and the rest is KV pool. Weights are counted from the config's shapes
(`parameter_count`); where a preset stands in for a mixture of experts (its note says so),
pass the real weight bytes instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from metronome.kv.cache import num_blocks_for
from metronome.model.config import ModelConfig

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB' (decimal), '141GiB' (binary), '1.5e9' or '4096' -> bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"bad size {text!r}: expected a number with an optional unit, e.g. "
                         "80GB, 141GiB, 512MiB, 1.5e9")
    number, unit = match.groups()
    unit = (unit or "").lower().removesuffix("b")
    return int(float(number) * _UNITS[unit])


def model_config(spec: str) -> ModelConfig:
    """'bundled', a Hugging Face directory or 'preset:NAME[:LAYERS]', shapes only."""
    from metronome.model.weights import parse_preset, resolve_model_dir

    if spec.startswith("preset:"):
        return parse_preset(spec)
    path = resolve_model_dir(spec)  # 'bundled': converted once into the cache, like serve
    return ModelConfig.from_hf_dict(json.loads((Path(path) / "config.json").read_text()),
                                    Path(path).name)


def parameter_count(cfg: ModelConfig) -> int:
    """Weights of the Llama-family forward (`model.llama`) with these shapes."""
    h = cfg.hidden_size
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = 2 * h * q_width + 2 * h * kv_width
    if cfg.qkv_bias:
        attention += q_width + 2 * kv_width
    if cfg.qk_norm:
        attention += 2 * cfg.head_dim
    layer = attention + 3 * h * cfg.intermediate_size + 2 * h
    heads = 1 if cfg.tie_word_embeddings else 2
    return heads * cfg.vocab_size * h + cfg.num_layers * layer + h


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KvBudget:
    """The pool: its blocks, and the sentence saying where that number came from."""

    num_blocks: int
    bytes_per_token: int
    block_size: int
    source: str

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.pool_tokens * self.bytes_per_token


def kv_budget(cfg: ModelConfig, dtype: torch.dtype, block_size: int, *,
              pool_tokens: int | None = None, pool_bytes: int | None = None,
              gpu_memory_bytes: int | None = None, utilization: float = 0.9,
              weights_bytes: int | None = None, reserve_bytes: int = 0) -> KvBudget:
    """Exactly one of `pool_tokens`, `pool_bytes`, `gpu_memory_bytes`."""
    given = [x is not None for x in (pool_tokens, pool_bytes, gpu_memory_bytes)]
    if sum(given) != 1:
        raise ValueError("give the KV budget one way: pool tokens, pool bytes, or a GPU's "
                         "memory")
    per_token = cfg.kv_bytes_per_token(dtype)
    if pool_tokens is not None:
        source = f"{pool_tokens} tokens"
    elif pool_bytes is not None:
        source = f"{pool_bytes} bytes"
    else:
        if not 0 < utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {utilization}")
        if weights_bytes is None:
            weights_bytes = parameter_count(cfg) * element_bytes(dtype)
        pool_bytes = int(gpu_memory_bytes * utilization) - weights_bytes - reserve_bytes
        source = (f"{gpu_memory_bytes / 1e9:g} GB x {utilization:g} - weights "
                  f"{weights_bytes / 1e9:.2f} GB - reserve {reserve_bytes / 1e9:g} GB")
        if pool_bytes < per_token * block_size:
            raise ValueError(f"no KV pool left: {source} = {pool_bytes / 1e9:.2f} GB")
    size = ({"pool_tokens": pool_tokens} if pool_tokens is not None
            else {"memory_bytes": pool_bytes, "bytes_per_token": per_token})
    return KvBudget(num_blocks_for(block_size, **size), per_token, block_size, source)
