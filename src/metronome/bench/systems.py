"""What the step timer times: engines behind `EnginePort` with sessions already long, and the
steps they take, the same for every engine (the native one, vLLM):

    Decode    every session feeds one token and samples one, each step
    Chunk     every session feeds a chunk of real text and samples one, one step
    Prefill   sessions prefill L tokens of real text to the end: one timed "step"

and transformers as a user writes it (`Transformers`). Sessions reach L tokens with
`Engine.fast_forward` (blocks allocated and slid as for real tokens, no model run), over a
pool filled with random K/V (a zeroed pool reads the kernel's shared zero page: too fast).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from metronome.engine.engine import Engine, EngineConfig, for_engine_path
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model.dtypes import AUTO_DTYPE, resolve_dtype
from metronome.stream import Stream

BLOCK_SIZE = 16
DTYPE = str(resolve_dtype(AUTO_DTYPE)).removeprefix("torch.")  # what `auto` serves here


def load_model(dtype: str = AUTO_DTYPE):
    from metronome.model.weights import load_model as load

    return load("bundled", resolve_dtype(dtype))


def native(model, pool_tokens: int, block_size: int = BLOCK_SIZE, path: str = "fast",
           **config) -> Engine:
    """The native engine on `model` with a pool of K/V that is not zero pages."""
    engine = Engine(model, for_engine_path(model, EngineConfig(
        block_size=block_size, pool_tokens=pool_tokens, **config), path))
    for seed, store in enumerate((engine.cache.k, engine.cache.v)):
        chunk = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed))
        chunk, flat = chunk.to(store.dtype), store.view(-1)
        for start in range(0, flat.numel(), chunk.numel()):
            flat[start:start + chunk.numel()] = chunk[: flat.numel() - start]
    return engine


def pool_tokens(policy: ResidencyPolicy, sessions: int, tokens: int, extra: int,
                block: int = BLOCK_SIZE) -> int:
    """A pool for `sessions` of `tokens` growing by `extra`: whole, or the bound, plus slack."""
    if not policy.bounded:
        return sessions * (tokens + extra + 2 * block)
    return sessions * (policy.max_blocks(block) + 3) * block


def open_sessions(engine, count: int, policy: ResidencyPolicy, length: int = 0) -> list[str]:
    """`count` sessions under `policy` (no EOS: every step decodes), `length` tokens long."""
    sids = []
    for _ in range(count):
        sids.append(engine.open_session(Stream.of(SessionSpec(policy=policy,
                                                              stop_token_ids=()))))
        assert not length or engine.fast_forward(sids[-1], length), "pool sized too small"
    return sids


def set_threads(wanted: int | None) -> None:
    """torch's threads, set where they differ (vLLM's CPU worker warns on every set)."""
    if wanted and torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


class Decode:
    """Every session of `sids` decodes one token a step, for `budget` steps (fed once);
    records the keys each step attended per session (the step cost model's input)."""

    def __init__(self, engine, sids: list[str], budget: int, threads: int | None = None):
        self.engine, self.sids, self.threads = engine, sids, threads
        self.attended: list[float] = []
        self.partial = 0  # steps in which not every session decoded
        for sid in sids:
            engine.submit(sid, [13], max_new_tokens=budget)

    def prepare(self) -> None:
        set_threads(self.threads)

    def step(self) -> None:
        out = self.engine.step()
        self.partial += len(out.input_tokens) != len(self.sids)
        self.attended.append(sum(out.context_tokens.values()) / len(self.sids))

    def finish(self) -> None:
        """Whatever budget is left (an engine that took a step more or less) is dropped."""
        for sid in self.sids:
            self.engine.cancel_generation(sid)
        while self.engine.has_work:
            self.engine.step()


class Chunk:
    """Every session of `sids` feeds `ids` and samples one token: one step, or more where the
    engine splits it (`extra_steps` counts those: a stall on KV, a scheduler's split)."""

    def __init__(self, engine, sids: list[str], ids: list[int], threads: int | None = None):
        self.engine, self.sids, self.ids, self.threads = engine, sids, ids, threads
        self.extra_steps = 0

    def prepare(self) -> None:
        set_threads(self.threads)
        for sid in self.sids:
            self.engine.submit(sid, self.ids, max_new_tokens=1)

    def step(self) -> None:
        self.engine.step()
        while self.engine.has_work:
            self.extra_steps += 1
            self.engine.step()


class Prefill:
    """`count` sessions each prefill `length` tokens of `ids` (from its own offset) to the end:
    one timed step. All but the last of `prefills` on fresh sessions (closed before the next),
    the last on `keep` (left for decoding)."""

    def __init__(self, engine, policy: ResidencyPolicy, keep: list[str], length: int,
                 ids: list[int], prefills: int, threads: int | None = None):
        self.engine, self.policy, self.keep, self.length, self.ids = (engine, policy, keep,
                                                                      length, ids)
        self.left, self.threads, self.sids, self.fresh = prefills, threads, [], []

    def prepare(self) -> None:
        set_threads(self.threads)
        for sid in self.fresh:
            self.engine.close(sid)
        self.left -= 1
        self.fresh = [] if not self.left else open_sessions(self.engine, len(self.keep),
                                                            self.policy)
        self.sids = self.fresh or self.keep

    def step(self) -> None:
        for k, sid in enumerate(self.sids):
            offset = (k * 997) % self.length
            self.engine.submit(sid, self.ids[offset:offset + self.length], max_new_tokens=0)
        while self.engine.has_work:
            self.engine.step()


class Transformers:
    """Hugging Face transformers as a user writes the same decode step: one batched forward
    on a DynamicCache already `tokens` long (random K/V), argmax fed back; no mask (every
    session has the same length)."""

    def __init__(self, model, sessions: int, tokens: int):
        from transformers import DynamicCache

        self.model, cfg, dtype = model, model.config, model.dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        gen = torch.Generator().manual_seed(3)
        shape = (sessions, cfg.num_key_value_heads, tokens, head_dim)
        self.cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            self.cache.update(torch.randn(shape, generator=gen).to(dtype),
                              torch.randn(shape, generator=gen).to(dtype), layer)
        self.ids = torch.arange(100, 100 + sessions).view(sessions, 1)
        self.attended: list[float] = []
        self.partial = 0

    def step(self) -> None:
        with torch.inference_mode():
            position = self.cache.get_seq_length()
            out = self.model(input_ids=self.ids, cache=self.cache, use_cache=True,
                             position_ids=torch.full((self.ids.shape[0], 1), position))
            self.ids = out.logits[:, -1].argmax(-1, keepdim=True)
        self.attended.append(position + 1)


def load_transformers(dtype: torch.dtype):
    """The bundled model in transformers (`Transformers`' model)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the bundled model is local: never the hub
    from transformers import AutoModelForCausalLM

    from metronome.model.weights import bundled_model_dir

    return AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=dtype).eval()


def text_ids(count: int) -> list[int]:
    """At least `count` token ids of Hamlet (repeated if it is shorter)."""
    from metronome.corpus import play_text
    from metronome.model.weights import load_tokenizer

    ids = load_tokenizer().encode(play_text("hamlet")).ids
    return ids * (count // len(ids) + 1)


def vllm_engine(kind: str, bound: ResidencyPolicy, pool_tokens: int, max_len: int,
                max_num_seqs: int, block_size: int = 32, **budget):
    """vLLM in-process on the bundled model, in `DTYPE`: "vllm" (stock: full attention),
    "vllm_sliding_window" (its own sliding window of the bound's S + W tokens on every
    layer: the same resident KV) or "vllm_metronome" (the bound, the plugin)."""
    from metronome.model.weights import bundled_model_dir
    from metronome.vllm.engine import VllmEngine, VllmEngineConfig

    model_dir = str(bundled_model_dir())
    overrides = None
    if kind == "vllm_sliding_window":
        layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
        overrides = {"layer_types": ["sliding_attention"] * layers,
                     "sliding_window": bound.sink_tokens + bound.window_tokens}
    return VllmEngine.start(VllmEngineConfig(
        model_dir=model_dir, policy=bound if kind == "vllm_metronome" else
        ResidencyPolicy.unbounded(), pool_tokens=pool_tokens, block_size=block_size,
        dtype=DTYPE, max_model_len=max_len, max_num_seqs=max_num_seqs, hf_overrides=overrides,
        **budget))
