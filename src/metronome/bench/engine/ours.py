"""Our engine as a bench system: N sessions of L tokens (synthetic history), each decoding
one token every step. Owns the engine, its pool and its sessions for one measurement."""

from __future__ import annotations

import torch

from metronome.bench.engine.plan import BLOCK_SIZE_TOKENS, Config
from metronome.bench.engine.profiling import phase_split, profile_steps
from metronome.engine.engine import Engine, EngineConfig, for_engine_path
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model.llama import LlamaModel


class OursRun:
    """Our engine with N sessions of L tokens (synthetic history), each decoding every step."""

    def __init__(self, model: LlamaModel, policy: ResidencyPolicy, sessions: int, tokens: int,
                 plan: Config, engine_path: str = "fast") -> None:
        self.plan, self.sessions = plan, sessions
        pool_tokens = self.pool_tokens(policy, sessions, tokens, plan)
        config = EngineConfig(block_size=BLOCK_SIZE_TOKENS, pool_tokens=pool_tokens,
                              max_step_tokens=max(4096, sessions))
        # "reference" sets the model up for it: give each path its own model object
        self.engine = Engine(model, for_engine_path(model, config, engine_path))
        fill_random(self.engine.cache.k, seed=1)
        fill_random(self.engine.cache.v, seed=2)
        spec = SessionSpec(policy=policy, stop_token_ids=())  # no EOS: every step decodes
        self.session_ids = []
        for i in range(sessions):
            sid = self.engine.open_session(spec)
            assert self.engine.fast_forward(sid, tokens), "pool sized too small for the history"
            self.engine.submit(sid, [100 + i], max_new_tokens=plan.decode_steps)
            self.session_ids.append(sid)

    @staticmethod
    def pool_tokens(policy: ResidencyPolicy, sessions: int, tokens: int, plan: Config) -> int:
        """Pool sized for this configuration: full history, or the policy's bound, plus slack."""
        block = BLOCK_SIZE_TOKENS
        if not policy.bounded:
            return sessions * (tokens + plan.decode_steps + 2 * block)
        blocks = -(-policy.sink_tokens // block) + -(-policy.window_tokens // block) + 3
        return sessions * blocks * block

    def step(self) -> None:
        result = self.engine.step()
        assert result.num_input_tokens == self.sessions, "every session decodes every step"

    def facts(self) -> dict:
        """Resident KV after the timed steps, and the keys the middle timed step attended."""
        sid, engine = self.session_ids[0], self.engine
        resident_tokens = engine.resident_tokens(sid)
        kv_bytes_per_token = engine.model.config.kv_bytes_per_token(engine.model.dtype)
        return {
            "kv_pool_bytes": engine.cache.nbytes,
            "attended_tokens": resident_tokens - (self.plan.repeats - self.plan.repeats // 2) + 1,
            "resident_tokens_per_session": resident_tokens,
            "resident_kv_bytes_per_session": engine.session_blocks(sid) * BLOCK_SIZE_TOKENS
            * kv_bytes_per_token,
        }

    def detail(self) -> dict:
        return {"phases_ms": phase_split(self.engine, self.plan.repeats),
                "profile": profile_steps(self.step, self.plan.repeats)}

    def close(self) -> None:
        for sid in self.session_ids:
            self.engine.close(sid)
        self.engine = None


def fill_random(store: torch.Tensor, seed: int) -> None:
    """Random normal K/V everywhere (a tiled random chunk: fast, and realistic for timing)."""
    chunk = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed)).to(store.dtype)
    flat = store.view(-1)
    for start in range(0, flat.numel(), chunk.numel()):
        end = min(start + chunk.numel(), flat.numel())
        flat[start:end].copy_(chunk[: end - start])
