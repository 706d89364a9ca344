"""The engine's side of one session: its KV block table, how far it has read the session's
input, its generation budget and its sampler.

The input itself stays in the session's `Stream` (`metronome.stream`: its one home); the
engine reads it there, up to what the beat fed it (`fed_tokens`, advanced by `feed`), from
its own cursor (`read_tokens`). A step takes at most its chunk limit from the front. When
the fed input is all read and the session still has a generation budget, the step samples
a token; that token is written to the KV before anything that follows it: at once while
the budget lasts (`feedback`), else with the session's next input (`carry`).

Per step, `plan` sets what the step does with the session (its chunk, where it starts,
whether it samples): the batch builder and the sampler read it there, as nano-vllm's model
runner reads a `Sequence`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from metronome.engine.sampling import SamplingParams
from metronome.kv.block_pool import BlockPool
from metronome.kv.block_table import BlockTable
from metronome.kv.residency import Positions, ResidencyPolicy


@dataclass(frozen=True)
class SessionSpec:
    policy: ResidencyPolicy = ResidencyPolicy.unbounded()
    sampling: SamplingParams = SamplingParams()
    # Today's engines' crash boundary (max_model_len); reaching it ends the session with
    # status context_full instead of taking the engine down.
    max_session_tokens: int | None = None
    return_logits: bool = False  # logits of every input position (quality experiments, tests)
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids


class SessionInput(Protocol):
    """What the engine reads of a session's record (`metronome.stream.Stream`), and nothing
    else of it: its id, its spec, and its input, from a cursor of the engine's own."""

    id: str
    spec: SessionSpec
    received_tokens: int  # input that reached the record
    fed_tokens: int  # of which the beat has fed the engine (direct use: `Engine.submit`)

    def append(self, data: torch.Tensor) -> tuple[int, int]: ...

    def read(self, start: int, max_tokens: int) -> torch.Tensor:
        """Input from offset `start`, up to `max_tokens`, of one kind."""

    def trim(self, read_tokens: int) -> None:
        """The engine has read everything before `read_tokens`."""


class Session:
    def __init__(self, stream: SessionInput, block_size: int, stop_ids) -> None:
        self.stream = stream  # where its input is (read only here)
        self.spec = stream.spec
        self.table = BlockTable(self.spec.policy, block_size)
        self.fed_tokens = 0  # the beat's feed as applied here (Stream.fed_tokens runs ahead
        # of it while a feed command is on its way)
        self.read_tokens = 0  # of which a step has read
        self.feedback: int | None = None  # a sampled token to write before anything else
        self.carry: int | None = None  # the last sampled token, written with the next input
        self.decode_budget = 0
        self.stop_token_ids = frozenset(stop_ids)
        self.generator = torch.Generator().manual_seed(self.spec.sampling.seed)
        self.ended = False
        # The tokens sampled since the session last read input or was given a new budget (its
        # latest reply), first to last: the table holds the blocks a rewind to its start
        # needs (`rewind_reply`).
        self.reply: list[int] = []
        self.pinning: list[int] | None = None  # new instructions to pin (`Engine.repin`)
        # ---- this step's plan (`plan`) --------------------------------------------------------
        self.chunk: torch.Tensor | None = None  # (n,) int64 ids or (n, hidden) embeddings
        self.start_position = 0  # absolute position of the chunk's first token
        self.chunk_fed_tokens = 0  # of the chunk, fed input (the rest: its own token)
        self.samples = False  # the chunk ends the fed input and a new token is due
        self.logits_rows = "none"  # "all" | "last" | "none"

    @property
    def id(self) -> str:
        return self.stream.id

    @property
    def unread_tokens(self) -> int:
        """Fed input not yet read, its own token to write back included."""
        return (self.feedback is not None) + self.fed_tokens - self.read_tokens

    @property
    def has_work(self) -> bool:
        return not self.ended and self.unread_tokens > 0

    def feed(self, num_tokens: int, max_new_tokens: int) -> None:
        """`num_tokens` more of the stream's input are the engine's, then up to
        `max_new_tokens` new tokens; a carried token goes in first."""
        if self.carry is not None:
            self.feedback, self.carry = self.carry, None
        self.fed_tokens += num_tokens
        self.decode_budget += max_new_tokens

    def next_chunk(self, max_tokens: int) -> tuple[torch.Tensor, int]:
        """Up to `max_tokens` of unread input from the front, of one kind (token ids, or
        embeddings), and how many of them are fed input. So a frame's input goes in one
        step with the token sampled last before it, not one step for each."""
        own = [] if self.feedback is None else [self.feedback]
        room = min(max_tokens - len(own), self.fed_tokens - self.read_tokens)
        if room <= 0:
            return torch.tensor(own, dtype=torch.int64), 0
        fed = self.stream.read(self.read_tokens, room)
        if not own:
            return fed, int(fed.shape[0])
        if fed.dtype != torch.int64:  # embeddings do not join a token id
            return torch.tensor(own, dtype=torch.int64), 0
        return torch.cat([torch.tensor(own, dtype=torch.int64), fed]), int(fed.shape[0])

    def plan(self, chunk: torch.Tensor, chunk_fed_tokens: int) -> None:
        """This step takes `chunk` (reserved in the table already)."""
        n = int(chunk.shape[0])
        self.chunk, self.chunk_fed_tokens = chunk, chunk_fed_tokens
        self.start_position = self.table.num_tokens - n
        self.samples = n == self.unread_tokens and self.decode_budget > 0
        self.logits_rows = "all" if self.spec.return_logits else (
            "last" if self.samples else "none")

    @property
    def chunk_tokens(self) -> int:
        return 0 if self.chunk is None else int(self.chunk.shape[0])

    def consume(self) -> None:
        """The planned chunk is in the KV. Input read ends the latest reply's rewind horizon."""
        fed = self.chunk_fed_tokens
        if self.chunk_tokens > fed:
            self.feedback = None
        if fed:
            self.reply = []
            self.table.hold_from = None
        self.read_tokens += fed
        assert self.read_tokens <= self.fed_tokens, (self.read_tokens, self.fed_tokens)
        self.chunk = None

    def set_policy(self, policy: ResidencyPolicy, pool: BlockPool) -> int:
        """Serve this session under `policy` from now on; blocks no future query can see
        under it go back to `pool`. Returns how many. A bound that grows (a longer window,
        more sinks) sees what is still resident of what it covers: freed blocks do not come
        back. Only between steps of this session: a chunk planned but not yet run still
        needs its blocks."""
        assert self.chunk is None, "a planned chunk still needs its blocks"
        self.spec = replace(self.spec, policy=policy)
        self.table.policy = policy
        return self.table.slide(pool)

    def rebound(self, policy: ResidencyPolicy, pool: BlockPool) -> int:
        """Switch an unbounded session to a bounded `policy` (KV pressure): its middle
        blocks go back to `pool`. Returns how many."""
        assert policy.bounded and not self.spec.policy.bounded, (self.spec.policy, policy)
        return self.set_policy(policy, pool)

    def roll(self, pool: BlockPool) -> ResidencyPolicy:
        """From now on, rolling positions (StreamingLLM): the session's next positions would
        put its sinks further from its queries than the model was trained on. Window keys
        keep their distances (RoPE scores depend on `p_q - p_k` only, `model.llama`); sink
        keys are scored at the query's slot in the cache, at most S + W + block away."""
        policy = replace(self.spec.policy, positions=Positions.ROLLING)
        self.set_policy(policy, pool)
        return policy

    def end_reply(self, pool: BlockPool) -> None:
        """The latest reply can no longer be rewound (a new one is asked for): the blocks
        only its rewind horizon held go back to `pool`. A reply is what one generation
        budget sampled, so a session that generates on and on without input (free-running)
        holds at most one budget's blocks beyond its bound, not everything since its last
        input. Between steps."""
        assert self.chunk is None, "a planned chunk still needs its blocks"
        if self.table.hold_from is None:
            return
        self.reply = []
        self.table.hold_from = None
        self.table.slide(pool)

    def rewind_reply(self, keep_tokens: int, pool: BlockPool) -> None:
        """Forget all but the first `keep_tokens` of the latest reply, in the KV too: the
        session is then as one that sampled only those (the last of them carried, written
        with its next input). Only between steps, while no input was read since the reply."""
        assert 0 <= keep_tokens <= len(self.reply) and self.table.hold_from is not None
        start = self.table.hold_from
        self.table.rewind(start + max(keep_tokens - 1, 0), pool)
        self.carry = self.reply[keep_tokens - 1] if keep_tokens else None
        self.feedback, self.decode_budget = None, 0
        self.reply = self.reply[:keep_tokens]
        if not self.reply:
            self.table.hold_from = None
        self.table.slide(pool)

    def end(self) -> None:
        self.ended = True
        self.feedback = None
        self.decode_budget = 0

    def accept_token(self, token_id: int) -> None:
        assert self.decode_budget > 0
        if not self.reply:  # a reply starts: it is written from here
            self.table.hold_from = self.table.num_tokens
        self.reply.append(token_id)
        self.decode_budget -= 1
        if token_id in self.stop_token_ids:
            self.decode_budget = 0
        if self.decode_budget > 0:
            self.feedback = token_id
        else:
            self.carry = token_id
