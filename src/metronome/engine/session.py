"""Engine-side session state: KV block table, pending input, generation budget, sampler.

Input is a queue of chunks; each chunk is token ids (int64, (n,)) or input embeddings
(float, (n, hidden)) such as an audio front end produces. A step consumes at most
`max_chunk_tokens` from the head chunk. When the queue empties and the session still has a
generation budget, the step samples a token; that token is fed back as the next input so
its KV is written before anything that follows it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import torch

from metronome.engine.sampling import SamplingParams
from metronome.kv.block_pool import BlockPool
from metronome.kv.block_table import BlockTable
from metronome.kv.residency import ResidencyPolicy


@dataclass(frozen=True)
class SessionSpec:
    policy: ResidencyPolicy = ResidencyPolicy.unbounded()
    sampling: SamplingParams = SamplingParams()
    # Today's engines' crash boundary (max_model_len); reaching it ends the session with
    # status context_full instead of taking the engine down.
    max_session_tokens: int | None = None
    return_logits: bool = False  # logits of every input position (quality experiments, tests)
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids


@dataclass
class InputChunk:
    data: torch.Tensor  # (n,) int64 token ids or (n, hidden) embeddings
    submitted: bool  # caller input; False for the session's own sampled token fed back


class Session:
    def __init__(self, session_id: int, spec: SessionSpec, block_size: int, stop_ids) -> None:
        self.session_id = session_id
        self.spec = spec
        self.table = BlockTable(spec.policy, block_size)
        self.pending: deque[InputChunk] = deque()
        self.carry: list[int] = []  # last sampled token, fed before the next submitted input
        self.decode_budget = 0
        self.stop_token_ids = frozenset(stop_ids)
        self.generator = torch.Generator().manual_seed(spec.sampling.seed)
        self.ended = False

    @property
    def has_work(self) -> bool:
        return not self.ended and bool(self.pending)

    def submit(self, chunk: torch.Tensor | None, max_new_tokens: int) -> None:
        if self.carry:
            self.pending.append(InputChunk(torch.tensor(self.carry, dtype=torch.int64), False))
            self.carry = []
        if chunk is not None and len(chunk):
            self.pending.append(InputChunk(chunk, True))
        self.decode_budget += max_new_tokens

    def next_chunk(self, max_tokens: int) -> tuple[torch.Tensor, int]:
        """Up to `max_tokens` of pending input from the front, across consecutive chunks of
        one kind (token ids, or embeddings), and how many of them are caller-submitted. So a
        frame's input goes in one step with the token sampled last before it (`carry`),
        not one step for that token and one for the frame."""
        first = self.pending[0].data
        parts, submitted, taken = [], 0, 0
        for chunk in self.pending:
            if taken >= max_tokens or chunk.data.dim() != first.dim():
                break
            piece = chunk.data[: max_tokens - taken]
            # fed-back tokens come only before caller input (a session samples only once
            # all its input is in), so a step's submitted tokens are its last ones
            assert chunk.submitted or submitted == 0, "a fed-back token after caller input"
            parts.append(piece)
            taken += len(piece)
            submitted += len(piece) if chunk.submitted else 0
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), submitted

    def takes_all_input(self, num_tokens: int) -> bool:
        """Would consuming `num_tokens` from the front leave no input pending?"""
        return num_tokens == sum(len(chunk.data) for chunk in self.pending)

    def consume(self, num_tokens: int) -> None:
        while num_tokens > 0:
            head = self.pending.popleft()
            if num_tokens < len(head.data):
                self.pending.appendleft(InputChunk(head.data[num_tokens:], head.submitted))
                return
            num_tokens -= len(head.data)

    def rebound(self, policy: ResidencyPolicy, pool: BlockPool) -> int:
        """Switch to a bounded `policy` from now on; blocks no future query can see under it
        (the middle, between sinks and window) go back to `pool`. Returns how many. Only
        between steps of this session: a chunk planned but not yet run still needs them."""
        assert policy.bounded and not self.spec.policy.bounded, (self.spec.policy, policy)
        self.spec = replace(self.spec, policy=policy)
        self.table.policy = policy
        return self.table.slide(pool)

    def end(self) -> None:
        self.ended = True
        self.pending.clear()
        self.decode_budget = 0

    def accept_token(self, token_id: int) -> None:
        assert self.decode_budget > 0
        self.decode_budget -= 1
        if token_id in self.stop_token_ids:
            self.decode_budget = 0
        if self.decode_budget > 0:
            self.pending.append(InputChunk(torch.tensor([token_id], dtype=torch.int64), False))
        else:
            self.carry = [token_id]
