"""The systems the vLLM benches compare, started the same way everywhere, and the real text
they prefill (Hamlet, tokenized by the bundled model's tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from metronome.bench.vllm.names import PLUGIN, SLIDING
from metronome.kv.residency import ResidencyPolicy
from metronome.model.dtypes import AUTO_DTYPE, resolve_dtype

# What `auto` serves in on this CPU (bf16 only where it computes bf16 natively), for every
# system alike
DTYPE = str(resolve_dtype(AUTO_DTYPE)).removeprefix("torch.")


def sliding_window_overrides(bound: ResidencyPolicy) -> dict:
    """hf_overrides giving the bundled model vLLM's own sliding window of S + W tokens on
    every layer: the bound's resident KV, without its sinks."""
    from metronome.model.weights import bundled_model_dir

    config = json.loads((Path(bundled_model_dir()) / "config.json").read_text())
    return {"layer_types": ["sliding_attention"] * config["num_hidden_layers"],
            "sliding_window": bound.sink_tokens + bound.window_tokens}


def vllm_engine(kind: str, bound: ResidencyPolicy, block_size: int, max_num_seqs: int,
                pool_tokens: int, max_len: int, max_step_tokens: int = 2048,
                max_chunk_tokens: int = 512):
    """vLLM in-process: stock (full attention), its own sliding window of the bound's
    sinks + window tokens on every layer (the same resident KV), or with the Metronome
    bound (the plugin)."""
    from metronome.model.weights import bundled_model_dir
    from metronome.vllm.engine import VllmEngine, VllmEngineConfig

    model_dir = str(bundled_model_dir())
    policy, overrides = ResidencyPolicy.unbounded(), None
    if kind == PLUGIN:
        policy = bound
    elif kind == SLIDING:
        overrides = sliding_window_overrides(bound)
    return VllmEngine.start(VllmEngineConfig(
        model_dir=model_dir, policy=policy, pool_tokens=pool_tokens, block_size=block_size,
        dtype=DTYPE, max_model_len=max_len, max_num_seqs=max_num_seqs,
        max_step_tokens=max_step_tokens, max_chunk_tokens=max_chunk_tokens,
        hf_overrides=overrides))


def native_engine(model, block_size: int, pool_tokens: int, **engine_config):
    """The native engine on `model` (its default, fast path)."""
    from metronome.engine.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(block_size=block_size, pool_tokens=pool_tokens,
                                      **engine_config))


def load_native_model():
    from metronome.model.weights import load_model

    return load_model("bundled", getattr(torch, DTYPE))


def text_ids(count: int) -> list[int]:
    """At least `count` token ids of Hamlet (repeated if it is shorter)."""
    from metronome.corpus import play_text
    from metronome.model.weights import load_tokenizer

    ids = load_tokenizer().encode(play_text("hamlet")).ids
    while len(ids) < count:
        ids = ids + ids
    return ids


def facts(model) -> dict:
    """What the vLLM benches record: model, dtype, vLLM's version and our engine path."""
    import vllm

    from metronome.bench.engine.facts import BUNDLED_MODEL, engine_path

    return {"model": BUNDLED_MODEL, "dtype": DTYPE, "vllm": vllm.__version__,
            "engine_path": f"vLLM {vllm.__version__} (CPU, in-process) vs native "
                           f"{engine_path('fast', model)}"}
