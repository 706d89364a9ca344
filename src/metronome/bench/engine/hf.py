"""Hugging Face transformers as a bench system: the same decode step as a user writes it
(one batched forward on a DynamicCache already L tokens long, argmax fed back)."""

from __future__ import annotations

import os

import torch

from metronome.bench.engine.plan import Config
from metronome.bench.engine.profiling import profile_steps
from metronome.model.weights import bundled_model_dir


def load_hf(dtype: torch.dtype):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the bundled model is local; never the hub
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_dir(), dtype=dtype).eval()


class HfRun:
    """transformers as a user writes it: one batched forward on a DynamicCache, argmax fed back.

    All sessions have the same length, so no attention mask; the cache grows by torch.cat.
    """

    def __init__(self, hf_model, kv_bytes_per_token: int, sessions: int, tokens: int,
                 plan: Config) -> None:
        self.model, self.plan = hf_model, plan
        self.kv_bytes_per_token = kv_bytes_per_token
        self.cache = self._filled_cache(hf_model, sessions, tokens)
        self.ids = torch.arange(100, 100 + sessions).view(sessions, 1)
        self.position = tokens

    @staticmethod
    def _filled_cache(hf_model, sessions: int, tokens: int):
        """A DynamicCache already `tokens` long for a batch of `sessions` (random K/V)."""
        from transformers import DynamicCache

        cfg = hf_model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        gen = torch.Generator().manual_seed(3)
        shape = (sessions, cfg.num_key_value_heads, tokens, head_dim)  # (B, kvh, L, hd)
        k = torch.randn(shape, generator=gen).to(hf_model.dtype)
        v = torch.randn(shape, generator=gen).to(hf_model.dtype)
        cache = DynamicCache(config=cfg)
        for layer_idx in range(cfg.num_hidden_layers):
            cache.update(k, v, layer_idx)  # each layer keeps its own copy (torch.cat)
        return cache

    def step(self) -> None:
        with torch.inference_mode():
            positions = torch.full((self.ids.shape[0], 1), self.position)
            out = self.model(input_ids=self.ids, cache=self.cache, position_ids=positions,
                             use_cache=True)
            self.ids = out.logits[:, -1].argmax(-1, keepdim=True)
            self.position += 1

    def facts(self) -> dict:
        """Cache length after the timed steps, and the keys the middle timed step attended."""
        resident_tokens = self.cache.get_seq_length()
        return {
            "attended_tokens": resident_tokens - (self.plan.repeats - self.plan.repeats // 2) + 1,
            "resident_tokens_per_session": resident_tokens,
            "resident_kv_bytes_per_session": resident_tokens * self.kv_bytes_per_token,
        }

    def detail(self) -> dict:
        return {"profile": profile_steps(self.step, self.plan.repeats)}

    def close(self) -> None:
        self.cache = None
