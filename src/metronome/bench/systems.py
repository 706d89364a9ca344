"""What the step timer times: engines behind `EnginePort` with sessions already long, and the
steps they take, the same for every engine (native, vLLM): `Decode` (every session one token
a step) and `Prefill` (sessions prefill L tokens of real text: one timed "step"). Native
sessions reach L with `Engine.fast_forward` over random K/V (a zeroed pool is the kernel's
shared zero page: it reads too fast).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from metronome.engine.engine import Engine, EngineConfig, for_engine_path
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model.dtypes import AUTO_DTYPE, resolve_dtype
from metronome.stream import Stream

DTYPE = str(resolve_dtype(AUTO_DTYPE)).removeprefix("torch.")  # what `auto` serves here


def load_model(dtype: str = AUTO_DTYPE):
    from metronome.model.weights import load_model as load

    return load("bundled", resolve_dtype(dtype))


def native(model, pool_tokens: int, block_size: int = 16, path: str = "fast",
           **config) -> Engine:
    """The native engine on `model` (its `path` set up), its pool random K/V."""
    engine = Engine(model, for_engine_path(model, EngineConfig(
        block_size=block_size, pool_tokens=pool_tokens, **config), path))
    for seed, store in enumerate((engine.cache.k, engine.cache.v)):
        chunk = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed))
        chunk, flat = chunk.to(store.dtype), store.view(-1)
        for start in range(0, flat.numel(), chunk.numel()):
            flat[start:start + chunk.numel()] = chunk[: flat.numel() - start]
    return engine


def pool_tokens(policy: ResidencyPolicy, sessions: int, tokens: int, extra: int) -> int:
    """A pool for `sessions` of `tokens` that grow by `extra`: whole, or their bound."""
    if not policy.bounded:
        return sessions * (tokens + extra + 32)
    return sessions * (policy.max_blocks(16) + 3) * 16


def open_sessions(engine, count: int, policy: ResidencyPolicy, length: int = 0) -> list[str]:
    """`count` sessions under `policy` (no EOS: every step decodes), `length` tokens long."""
    sids = [engine.open_session(Stream.of(SessionSpec(policy=policy, stop_token_ids=())))
            for _ in range(count)]
    assert not length or all(engine.fast_forward(s, length) for s in sids), "pool too small"
    return sids


def set_threads(wanted: int | None) -> None:
    """torch's threads, set only where they differ (vLLM's CPU worker warns at every set)."""
    if wanted and torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


class Decode:
    """Every session of `sids` decodes one token a step, for `budget` steps (fed once);
    `attended`: the keys each step attended per session (the step cost model's input)."""

    def __init__(self, engine, sids: list[str], budget: int, threads: int | None = None):
        self.engine, self.sids, self.threads = engine, sids, threads
        self.attended = []
        for sid in sids:
            engine.submit(sid, [13], max_new_tokens=budget)

    def prepare(self) -> None:
        set_threads(self.threads)

    def step(self) -> None:
        out = self.engine.step()
        self.attended.append(sum(out.context_tokens.values()) / len(self.sids))

    def finish(self) -> None:
        """Whatever budget is left (an engine that took a step more or less) is dropped."""
        for sid in self.sids:
            self.engine.cancel_generation(sid)
        while self.engine.has_work:
            self.engine.step()


class Prefill:
    """Sessions `sids` each prefill `length` tokens of `ids` (from its own offset) to the end:
    one timed step (take it once: the sessions are `length` longer after it)."""

    def __init__(self, engine, sids: list[str], length: int, ids: list[int],
                 threads: int | None = None):
        self.engine, self.sids, self.length, self.ids, self.threads = (engine, sids, length,
                                                                       ids, threads)

    def prepare(self) -> None:
        set_threads(self.threads)

    def step(self) -> None:
        for k, sid in enumerate(self.sids):
            offset = (k * 997) % self.length
            self.engine.submit(sid, self.ids[offset:offset + self.length], max_new_tokens=0)
        while self.engine.has_work:
            self.engine.step()


def text_ids(count: int) -> list[int]:
    """At least `count` token ids of Hamlet (repeated if it is shorter)."""
    from metronome.corpus import play_text
    from metronome.model.weights import load_tokenizer

    ids = load_tokenizer().encode(play_text("hamlet")).ids
    return ids * (count // len(ids) + 1)


def vllm_engine(kind: str, bound: ResidencyPolicy, pool_tokens: int, max_len: int,
                max_num_seqs: int, block_size: int = 32, **options):
    """vLLM in-process on the bundled model in `DTYPE`: "vllm" (stock: full attention),
    "vllm_sliding_window" (its own sliding window of the bound's S + W tokens on every
    layer: the same resident KV) or "vllm_metronome" (the bound: the plugin); `options` go
    to `VllmEngineConfig` (step budgets, `mode`: vLLM's default or eager)."""
    from metronome.model.weights import bundled_model_dir
    from metronome.vllm.engine import VllmEngine, VllmEngineConfig

    model_dir, overrides = str(bundled_model_dir()), None
    if kind == "vllm_sliding_window":
        layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
        overrides = {"layer_types": ["sliding_attention"] * layers,
                     "sliding_window": bound.sink_tokens + bound.window_tokens}
    return VllmEngine.start(VllmEngineConfig(
        model_dir=model_dir, policy=bound if kind == "vllm_metronome" else
        ResidencyPolicy.unbounded(), pool_tokens=pool_tokens, block_size=block_size,
        dtype=DTYPE, max_model_len=max_len, max_num_seqs=max_num_seqs, hf_overrides=overrides,
        **options))
