"""The engine: sessions with bounded KV in one fixed block pool, advanced by batched steps.

A small synchronous API for the layers above (runtime, server, experiments): `open_session`
(a `Stream`, the session's record), `feed` (how much of its input the engine may read, and
how many tokens to generate after it), `step`, `close`, `pool_stats`. No sockets and no
clocks here. It implements `metronome.runtime.ports.EnginePort`, the one seam the runtime
drives an engine by. Used directly (tests, benches), `submit` appends input to a session's
stream and feeds it in one call.

One `step()` = plan (which sessions, how many tokens each, blocks for them) -> one batched
forward over all of them -> sample -> slide windows. A session whose blocks cannot be
allocated is reported `stalled_kv` and keeps its input for a later step; nothing raises.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from metronome.engine.batch_builder import PAGED_MAX_CHUNK_TOKENS, build_batch, paged_first
from metronome.engine.chunking import chunk_limit
from metronome.engine.sampling import greedy_ids, sample
from metronome.engine.session import Session, SessionInput, SessionSpec
from metronome.engine.snapshot import SessionSnapshot, restore, take
from metronome.engine.types import EngineFeature, PoolStats, Rebound, StepOutput, WorkStatus
from metronome.kv.block_pool import BlockPool
from metronome.kv.cache import KVCache, num_blocks_for
from metronome.kv.residency import Positions, ResidencyPolicy
from metronome.model.linear import packing_supported
from metronome.model.llama import LlamaModel
from metronome.workload_defaults import BLOCK_SIZE_TOKENS, POOL_TOKENS

ATTENTION_MODES = ("auto", "paged", "dense")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = BLOCK_SIZE_TOKENS
    # The pool's size: in tokens, or as a memory budget in bytes (at most one of the two;
    # neither: workload_defaults.POOL_TOKENS).
    pool_tokens: int | None = None
    pool_memory_bytes: int | None = None
    # Input tokens one session may process in one step. Every query in a step is padded to
    # the longest chunk, so one long prompt would slow every other session's step: keep it
    # a few frames' worth (a 1 s audio frame is 12-25 tokens).
    max_chunk_tokens: int = 64
    max_step_tokens: int = 4096  # input tokens of all sessions in one step
    # A session's chunk in a step of long prefills only, when the pool can spare the blocks
    # (`engine.chunking`); at most max_chunk_tokens: never larger.
    max_prefill_chunk_tokens: int = 256
    # The longest reply a session samples before it reads input again (a server's
    # `--max-response-tokens`): its rewind horizon holds the blocks the window slid past
    # during it, so a session's peak is its bound plus that reply and one chunk
    # (`blocks_per_session`); 0: replies short enough for the chunk's allowance to cover.
    max_reply_tokens: int = 0
    # Server limits on what sessions may ask for:
    allow_unbounded: bool = True
    max_window_tokens: int = 8192
    max_sink_tokens: int = 64
    # Graceful degradation (opt-in): when the pool cannot supply a session's blocks, switch
    # unbounded sessions to this bound (largest first) until it can, instead of stalling.
    pressure_policy: ResidencyPolicy | None = None
    # Attention: "auto" reads KV in place with the compiled paged kernel for chunks of at most
    # `paged_max_chunk_tokens` (decode, short frames) when it builds here, else everything
    # takes the dense reference path; "paged" insists on the kernel (error if unavailable);
    # "dense" is the reference path alone. Results agree within float rounding.
    attention: str = "auto"
    paged_max_chunk_tokens: int = PAGED_MAX_CHUNK_TOKENS
    # The positions the model was trained on (None: its config's max_position_embeddings). A
    # bounded session with sinks under absolute positions that would go past it goes on
    # under rolling positions (`Session.roll`) instead: a session under a bound never ends.
    position_limit_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, "
                             f"got {self.attention!r}")
        if self.paged_max_chunk_tokens < 0:
            raise ValueError(f"paged_max_chunk_tokens must be >= 0, got "
                             f"{self.paged_max_chunk_tokens}")
        for name in ("block_size", "max_chunk_tokens", "max_step_tokens",
                     "max_prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_reply_tokens < 0:
            raise ValueError(f"max_reply_tokens must be >= 0, got {self.max_reply_tokens}")
        if self.max_step_tokens < self.max_chunk_tokens:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must be >= "
                             f"max_chunk_tokens ({self.max_chunk_tokens})")
        if self.pool_tokens is not None and self.pool_memory_bytes is not None:
            raise ValueError(f"size the KV pool by pool_tokens ({self.pool_tokens}) or by "
                             f"pool_memory_bytes ({self.pool_memory_bytes}), not both")
        if self.pressure_policy is not None and not self.pressure_policy.bounded:
            raise ValueError(f"pressure_policy must be a bound, got {self.pressure_policy}")

    @property
    def pool_size(self) -> dict[str, int]:
        """The pool's size as `num_blocks_for` takes it: tokens or memory bytes."""
        if self.pool_memory_bytes is not None:
            return {"memory_bytes": self.pool_memory_bytes}
        tokens = POOL_TOKENS if self.pool_tokens is None else self.pool_tokens
        return {"pool_tokens": tokens}


def check_policy_limits(policy: ResidencyPolicy, config: EngineConfig) -> None:
    """The engine's limits on what a session's bound may ask for (the one place they are
    checked: the engine per session, the server once for its configured policy)."""
    if policy.window_tokens is not None and policy.window_tokens > config.max_window_tokens:
        raise ValueError(f"window {policy.window_tokens} exceeds the engine's limit "
                         f"{config.max_window_tokens}")
    if policy.sink_tokens > config.max_sink_tokens:
        raise ValueError(f"sinks {policy.sink_tokens} exceed the engine's limit "
                         f"{config.max_sink_tokens}")


def blocks_per_session(policy: ResidencyPolicy, config: EngineConfig) -> int | None:
    """Most blocks one session under `policy` holds at once in an engine of `config`: its
    bound, plus the blocks of one full chunk written before the step slides the window, plus
    its latest reply's (`max_reply_tokens`: the rewind horizon keeps the window where the
    reply began until input is read, and that input's chunk is written before it lets go;
    None: unbounded, no bound)."""
    return policy.max_blocks(config.block_size,
                             config.max_chunk_tokens + config.max_reply_tokens)


def memory_ceiling(policy: ResidencyPolicy, config: EngineConfig, num_blocks: int) -> int | None:
    """How many sessions under `policy` a pool of `num_blocks` holds at their peak, all at
    once: beyond it a bounded session can stall on KV (None: unbounded, no ceiling)."""
    per_session = blocks_per_session(policy, config)
    return None if per_session is None else num_blocks // per_session


def check_pool_fits(policy: ResidencyPolicy, config: EngineConfig, num_blocks: int) -> None:
    """Refuse a pool too small for one session under `policy`, with the numbers."""
    per_session = blocks_per_session(policy, config)
    if per_session is None or per_session <= num_blocks:
        return
    block = config.block_size
    steady = policy.max_blocks(block)
    assert steady is not None  # bounded, as per_session is
    raise ValueError(
        f"a KV pool of {num_blocks} blocks of {block} tokens ({num_blocks * block} tokens) "
        f"cannot hold one {policy} session: it needs {per_session} blocks ({steady} for its "
        f"sinks and window, {per_session - steady} more while a {config.max_chunk_tokens}-"
        f"token chunk is written" + (f" after a {config.max_reply_tokens}-token reply held "
                                     f"for a rewind" if config.max_reply_tokens else "")
        + f"), so a pool of at least {per_session * block} tokens")


ENGINE_PATHS = ("fast", "reference")


def for_engine_path(model: LlamaModel, config: EngineConfig, path: str) -> EngineConfig:
    """Set up `model` and `config` for one of the engine's code paths: "fast" (the defaults:
    paged kernel where it builds, prepacked projections) or "reference" (dense attention and
    plain `F.linear` and torch's elementwise ops: the engine as it was before its fast path,
    for before/after runs)."""
    if path not in ENGINE_PATHS:
        raise ValueError(f"engine path must be one of {', '.join(ENGINE_PATHS)}, got {path!r}")
    reference = path == "reference"
    model.use_packed_linear(not reference and packing_supported(model.dtype))
    model.use_fused_ops(not reference)
    return replace(config, attention="dense") if reference else config


def _attention_kernel(config: EngineConfig):
    """(kernel module or None, chunk limit of the paged path) for `config.attention`."""
    if config.attention == "dense" or config.paged_max_chunk_tokens == 0:
        return None, 0
    from metronome.model import native

    module = native.kernel()
    if module is None:
        if config.attention == "paged":
            raise RuntimeError(f"attention='paged' but {native.unavailable_reason()}")
        return None, 0
    return module, config.paged_max_chunk_tokens


class SessionError(ValueError):
    """A request about one session that cannot be honoured (unknown id, ended, bad input)."""


def check_token_ids(token_ids: list[int] | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids as a (n,) int64 tensor within [0, vocab_size), or `SessionError` with the
    reason (every engine validates token input with this)."""
    try:
        ids = torch.as_tensor(token_ids, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as err:
        raise SessionError(f"token_ids must be integers: {err}") from None
    if ids.dim() != 1:
        raise SessionError(f"token_ids must be 1-D, got shape {tuple(ids.shape)}")
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise SessionError(f"token ids must be in [0, {vocab_size}), got values from "
                           f"{int(ids.min())} to {int(ids.max())}")
    return ids


def unsupported(engine_name: str, feature: EngineFeature) -> SessionError:
    """The error of an engine asked for a feature it does not declare (`features`)."""
    return SessionError(f"the {engine_name} engine does not serve {feature.value}")


def check_feed(session_id: str, ended_reason: str, num_tokens: int,
               max_new_tokens: int) -> None:
    """`feed`'s arguments, the same for every engine: a session that has ended (`ended_reason`
    non-empty) takes no more input, and the counts are not negative (`SessionError`)."""
    if ended_reason:
        raise SessionError(f"session {session_id} has ended ({ended_reason})")
    if max_new_tokens < 0 or num_tokens < 0:
        raise SessionError(f"num_tokens and max_new_tokens must be >= 0, got "
                           f"{num_tokens} and {max_new_tokens}")


def submit_all(engine, stream: SessionInput, token_ids: list[int] | torch.Tensor | None,
               embeddings: torch.Tensor | None, max_new_tokens: int) -> None:
    """An engine used directly (no beat): validate input, append it to the session's stream
    and feed everything the stream holds (each engine's `submit`)."""
    data = engine.check_input(token_ids, embeddings)
    if data is not None and len(data):
        stream.append(data)
    engine.feed(stream.id, stream.received_tokens - stream.fed_tokens, max_new_tokens)
    stream.fed_tokens = stream.received_tokens


class Engine:
    def __init__(self, model: LlamaModel, config: EngineConfig = EngineConfig()) -> None:
        self.model = model
        self.config = config
        cfg = model.config
        num_blocks = num_blocks_for(
            config.block_size, bytes_per_token=cfg.kv_bytes_per_token(model.dtype),
            **config.pool_size,
        )
        self.pool = BlockPool(num_blocks)
        self.cache = KVCache(
            cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
            model.dtype,
        )
        self.kernel, self.paged_max_chunk_tokens = _attention_kernel(config)
        self.position_limit_tokens = (config.position_limit_tokens
                                      or model.config.max_position_embeddings)
        self.sessions: dict[str, Session] = {}
        self._notes: list[Rebound] = []  # bounds changed between steps, for the next step's out
        self._rotation = 0  # where the next step starts handing out its token budget
        self.step_thread_id: int | None = None  # the engine's thread (engine.snapshot's rule)

    # ---- session lifecycle -------------------------------------------------------------
    def open_session(self, stream: SessionInput) -> str:
        """Serve `stream` (its id and spec; its input is read there). Returns its id."""
        self._check_spec(stream)
        if stream.id in self.sessions:
            raise SessionError(f"session {stream.id} is already open")
        stop_ids = stream.spec.stop_token_ids
        if stop_ids is None:
            stop_ids = self.model.config.eos_token_ids
        self.sessions[stream.id] = Session(stream, self.config.block_size, stop_ids)
        return stream.id

    def feed(self, session_id: str, num_tokens: int, max_new_tokens: int = 0) -> None:
        """The next `num_tokens` of the session's stream are the engine's to process, then up
        to `max_new_tokens` new tokens (the stream validated and holds the input)."""
        session = self._get(session_id)
        check_feed(session_id, "context full" if session.ended else "", num_tokens,
                   max_new_tokens)
        assert session.fed_tokens + num_tokens <= session.stream.received_tokens, session.stream
        if max_new_tokens and not session.decode_budget:  # a new reply, with or without
            session.end_reply(self.pool)  # input first: the last one is no longer the latest
        session.feed(num_tokens, max_new_tokens)

    def submit(self, session_id: str, token_ids: list[int] | torch.Tensor | None = None,
               embeddings: torch.Tensor | None = None, max_new_tokens: int = 0) -> None:
        """Used directly (no beat): append input to the session's stream and feed all of it."""
        submit_all(self, self._get(session_id).stream, token_ids, embeddings, max_new_tokens)

    def check_input(self, token_ids: list[int] | torch.Tensor | None,
                    embeddings: torch.Tensor | None) -> torch.Tensor | None:
        """Input validated against the model: (n,) int64 ids or (n, hidden) embeddings in the
        model's dtype; None for neither; `SessionError` with the reason. No engine state:
        safe from any thread."""
        if token_ids is not None and embeddings is not None:
            raise SessionError("submit token_ids or embeddings, not both")
        if token_ids is not None:
            return check_token_ids(token_ids, self.model.config.vocab_size)
        if embeddings is not None:
            return self._check_embeddings(embeddings)
        return None

    def cancel_generation(self, session_id: str) -> None:
        """Drop the session's remaining generation budget (its input is still processed)."""
        self._get(session_id).decode_budget = 0

    # ---- a session's bound, pinned prefix and latest reply ------------------------------------
    def set_policy(self, session_id: str, policy: ResidencyPolicy) -> int:
        """Serve the session under `policy` from now on (its spec's, within the engine's
        limits); blocks no future query sees under it go back to the pool. Returns how many.
        A window that grows covers what is still resident; a session whose window has slid
        cannot become unbounded (`SessionError`). Between steps (a beat's engine command)."""
        session = self._get(session_id)
        self._check_policy(policy)
        table = session.table
        if not policy.bounded and len(table.logical_to_block_id) < -(
                -table.num_tokens // self.config.block_size):
            raise SessionError(f"session {session_id}'s window has slid already: what left it "
                               "is gone, so it cannot become unbounded")
        return session.set_policy(policy, self.pool)

    def repin(self, session_id: str, token_ids: list[int] | torch.Tensor) -> bool:
        """Make `token_ids` the session's pinned prefix (its new instructions), in place of the
        one it has: re-prefilled at positions 0..n-1 into fresh blocks (attending to each
        other only, as at a session's start), the old prefix's blocks freed, the bound's sinks
        n from then on. Done as soon as the window has left the positions both prefixes span
        (now, or at the end of a later step: until then the old prefix stays pinned). True if
        done now. Between steps (a beat's engine command)."""
        session = self._get(session_id)
        ids = check_token_ids(token_ids, self.model.config.vocab_size)
        if not session.spec.policy.bounded:
            raise SessionError(f"session {session_id} is unbounded: it keeps every token, "
                               "nothing needs pinning")
        if not 0 < len(ids) <= self.config.max_sink_tokens:
            raise SessionError(f"a pinned prefix of {len(ids)} tokens is outside the engine's "
                               f"limit (1 to {self.config.max_sink_tokens})")
        session.pinning = ids.tolist()
        return self._pin(session)

    def rewind_reply(self, session_id: str, keep_tokens: int) -> int:
        """Forget all but the first `keep_tokens` of the session's latest reply, from its KV
        too (`Session.rewind_reply`): afterwards it is token for token the session that only
        sampled those. Possible while it has read no input since the reply (its rewind
        horizon), else `SessionError`. Returns the tokens forgotten."""
        session = self._get(session_id)
        reply = len(session.reply)
        if not reply:
            raise SessionError(f"session {session_id} has no reply to rewind: input was read "
                               "after it, or a new reply was asked for (or it never sampled)")
        if not 0 <= keep_tokens <= reply:
            raise SessionError(f"keep_tokens must be in [0, {reply}], got {keep_tokens}")
        if session.unread_tokens - (session.feedback is not None) > 0:
            raise SessionError(f"session {session_id} has input waiting after its reply")
        session.rewind_reply(keep_tokens, self.pool)
        return reply - keep_tokens

    def _pin(self, session: Session) -> bool:
        """`repin`'s work, if the window has left the positions both prefixes span and the
        pool has the new prefix's blocks."""
        ids, table, block = session.pinning, session.table, self.config.block_size
        assert ids is not None, "repin set what to pin"
        policy = session.spec.policy
        num_blocks = -(-len(ids) // block)
        if table.first_held_block < max(table.num_sink_blocks, num_blocks):
            return False
        fresh = self.pool.allocate(num_blocks)
        if fresh is None:
            return False
        old = [table.logical_to_block_id.pop(k) for k in range(table.num_sink_blocks)
               if k in table.logical_to_block_id]
        table.logical_to_block_id = dict(enumerate(fresh)) | table.logical_to_block_id
        session.set_policy(replace(policy, sink_tokens=len(ids)), self.pool)
        session.chunk = torch.tensor(ids, dtype=torch.int64)
        session.start_position, session.chunk_fed_tokens = 0, 0
        session.samples, session.logits_rows = False, "none"
        try:
            self.forward([session])
        finally:
            session.chunk, session.pinning = None, None
        self.pool.free(old)
        self._notes.append(Rebound(session.id, session.spec.policy, len(old),
                                   table.resident_tokens, reason="pinned"))
        return True

    def close(self, session_id: str) -> None:
        """End a session and return every one of its blocks to the pool."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise SessionError(f"unknown session {session_id}")
        session.table.release(self.pool)

    def snapshot_session(self, session_id: str) -> SessionSnapshot:
        """A bounded session's whole state (engine.snapshot; engine thread, between steps)."""
        return take(self, self._get(session_id))

    def restore_session(self, snapshot: SessionSnapshot, stream: SessionInput) -> bool:
        """Open `snapshot` here as `stream`, continuing where it was taken; False when the
        pool cannot supply its blocks."""
        return restore(self, snapshot, stream)

    # ---- stepping -------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return any(s.has_work for s in self.sessions.values())

    def step(self) -> StepOutput:
        self.step_thread_id = threading.get_ident()
        out = StepOutput()
        work = self._plan(out)
        if work:
            work = paged_first(work, self.paged_max_chunk_tokens)
            self._finish(work, self.forward(work), out)
            for session in work:
                if session.pinning is not None:
                    self._pin(session)
        out.rebounds.extend(self._notes)
        self._notes.clear()
        return out

    def forward(self, work: list[Session]) -> torch.Tensor:
        """One batched forward over planned sessions (in `paged_first` order): logits rows."""
        batch = self.build_batch(work)
        return self.model.forward(batch, self.cache, self.kernel)

    def build_batch(self, work: list[Session]):
        batch = build_batch(work, self.model.embed, self.model.dtype, self.config.block_size,
                            self.paged_max_chunk_tokens)
        if batch.paged is not None:
            batch.paged.check(self.pool.num_blocks)
        return batch

    def _plan(self, out: StepOutput) -> list[Session]:
        """This step's sessions, each with its chunk planned and its blocks reserved; the
        ones stalled on KV or ended are in `out` already."""
        ready = [s for s in self.sessions.values() if s.has_work]
        if ready:
            self._rotation %= len(ready)
            ready = ready[self._rotation :] + ready[: self._rotation]
            self._rotation += 1
        config = self.config
        budget = config.max_step_tokens
        limit = chunk_limit(ready, self.sessions.values(), self.pool.num_free_blocks,
                            config.max_chunk_tokens, config.max_prefill_chunk_tokens, budget,
                            config.block_size)
        work: list[Session] = []
        for session in ready:
            if budget <= 0:
                break
            chunk, fed = session.next_chunk(min(limit, budget))
            self._keep_in_range(session, len(chunk), out)
            status = self._reserve(session, len(chunk))
            if status is WorkStatus.STALLED_KV and self._relieve(session, len(chunk), work,
                                                                 out):
                status = self._reserve(session, len(chunk))
            if status is not WorkStatus.OK:
                out.status[session.id] = status
                continue
            budget -= len(chunk)
            session.plan(chunk, fed)
            out.status[session.id] = WorkStatus.OK  # the output keeps this (rotation) order
            work.append(session)
        return work

    def _keep_in_range(self, session: Session, num_tokens: int, out: StepOutput) -> None:
        """A bounded session whose next positions would leave the model's trained range rolls
        (its sinks would be further from the query than any distance it was trained on)."""
        policy = session.spec.policy
        if (policy.bounded and policy.sink_tokens and policy.positions is Positions.ABSOLUTE
                and session.table.num_tokens + num_tokens > self.position_limit_tokens):
            rolled = session.roll(self.pool)
            out.rebounds.append(Rebound(session.id, rolled, 0, session.table.resident_tokens,
                                        reason="position_limit"))

    def _reserve(self, session: Session, num_tokens: int) -> WorkStatus:
        limit = session.spec.max_session_tokens
        if limit is not None and session.table.num_tokens + num_tokens > limit:
            session.end()
            return WorkStatus.CONTEXT_FULL
        if not session.table.append(num_tokens, self.pool):
            return WorkStatus.STALLED_KV
        return WorkStatus.OK

    def _relieve(self, session: Session, num_tokens: int, planned: list[Session],
                 out: StepOutput) -> bool:
        """KV pressure: bound unbounded sessions to `pressure_policy`, the one holding the
        most blocks first, until the pool has `session`'s blocks. Sessions already planned
        in this step keep their blocks (their chunk still needs them). True if it now fits."""
        policy = self.config.pressure_policy
        if policy is None:
            return False
        needed = session.table.blocks_needed(num_tokens)
        busy = {s.id for s in planned}
        candidates = sorted((s for s in self.sessions.values()
                             if not s.spec.policy.bounded and s.id not in busy
                             and s.table.blocks_freed_by(policy) > 0),  # else: no relief
                            key=lambda s: len(s.table.logical_to_block_id), reverse=True)
        for candidate in candidates:
            if self.pool.num_free_blocks >= needed:
                break
            freed = candidate.rebound(policy, self.pool)
            out.rebounds.append(Rebound(candidate.id, policy, freed,
                                        candidate.table.resident_tokens))
        return self.pool.num_free_blocks >= needed

    def _finish(self, work: list[Session], logits: torch.Tensor, out: StepOutput) -> None:
        row = 0
        argmax_ids = greedy_ids(logits, getattr(self.model, "fused", None))  # one, batched
        for session in work:
            rows = {"all": session.chunk_tokens, "last": 1, "none": 0}[session.logits_rows]
            own_logits = logits[row : row + rows]
            row += rows
            sid = session.id
            out.input_tokens[sid] = session.chunk_tokens
            out.consumed_tokens[sid] = session.chunk_fed_tokens
            samples = session.samples
            session.consume()
            session.stream.trim(session.read_tokens)
            out.context_tokens[sid] = session.table.visible_tokens(session.table.num_tokens - 1)
            if session.spec.return_logits:
                out.logits[sid] = own_logits
            out.new_token_ids[sid] = []
            if samples:
                params = session.spec.sampling
                token = argmax_ids[row - 1] if params.greedy else sample(
                    own_logits[-1], params, session.generator
                )
                session.accept_token(token)
                out.new_token_ids[sid].append(token)
            session.table.slide(self.pool)
            if session.decode_budget > 0:
                out.generating.add(sid)

    def warm_up(self, prompt_tokens: int = 32, new_tokens: int = 4) -> None:
        """Run one throwaway session through prefill and decode, then close it, so the first
        real frame does not pay for kernel selection and first-touch allocations."""
        from metronome.stream import Stream

        block = self.config.block_size
        if self.pool.num_free_blocks * block < prompt_tokens + new_tokens:
            return  # a pool this small serves no warm-up; the first frame pays instead
        stream = Stream("metronome-warm-up", spec=SessionSpec(stop_token_ids=()))
        self.open_session(stream)
        try:
            self.submit(stream.id, [0] * prompt_tokens, max_new_tokens=new_tokens)
            while self.sessions[stream.id].has_work:
                self.step()
        finally:
            self.close(stream.id)
            self.step_thread_id = None  # warm-up ran on a startup thread, not the stepper

    def fast_forward(self, session_id: str, num_tokens: int) -> bool:
        """Lengthen a session by `num_tokens` without running the model.

        For benchmarks and capacity experiments that need sessions 8k tokens deep without
        paying for their prefill: blocks are allocated and slid exactly as for real tokens,
        and their K/V is whatever the pool slots hold. Returns False (with the tokens that
        fit added) if the pool runs dry.
        """
        session = self._get(session_id)
        block = self.config.block_size
        while num_tokens > 0:
            n = min(num_tokens, block - session.table.num_tokens % block)
            if not session.table.append(n, self.pool):
                return False
            session.table.slide(self.pool)
            num_tokens -= n
        return True

    # ---- introspection -------------------------------------------------------------------
    accepts_embeddings = True  # input embeddings (an audio front end's) as well as token ids
    features = frozenset(EngineFeature)  # every optional feature: per-session bounds, re-pinning,
    # rewinding a reply, snapshots

    def shutdown(self) -> None:
        """Release what outlives the object (nothing here: the pool is plain tensors)."""

    def memory_ceiling(self, policy: ResidencyPolicy) -> int | None:
        """Sessions under `policy` this engine's pool holds at their peak (None: unbounded)."""
        return memory_ceiling(policy, self.config, self.pool.num_blocks)

    def pool_stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.pool.num_blocks,
            block_size=self.config.block_size,
            used_blocks=self.pool.num_used_blocks,
            free_blocks=self.pool.num_free_blocks,
            pinned_blocks=sum(s.table.num_pinned_blocks for s in self.sessions.values()),
        )

    def resident_tokens(self, session_id: str) -> int:
        return self._get(session_id).table.resident_tokens

    def resident_tokens_by_session(self) -> dict[str, int]:
        """Live KV tokens of every open session."""
        return {sid: s.table.resident_tokens for sid, s in self.sessions.items()}

    def session_blocks(self, session_id: str) -> int:
        return len(self._get(session_id).table.logical_to_block_id)

    def session_tokens(self, session_id: str) -> int:
        """Tokens the session has written (its absolute length)."""
        return self._get(session_id).table.num_tokens

    # ---- validation ------------------------------------------------------------------------
    def _get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(f"unknown session {session_id}")
        return session

    def _check_spec(self, stream: SessionInput) -> None:
        spec = stream.spec
        self._check_policy(spec.policy)
        if spec.max_session_tokens is not None and spec.max_session_tokens < 1:
            raise SessionError(f"max_session_tokens must be >= 1, got {spec.max_session_tokens}")

    def _check_policy(self, policy: ResidencyPolicy) -> None:
        cfg = self.config
        if not policy.bounded and not cfg.allow_unbounded:
            raise SessionError("this engine does not allow unbounded sessions")
        try:
            check_policy_limits(policy, cfg)
            policy.slide(cfg.block_size)
        except ValueError as err:
            raise SessionError(str(err)) from None

    def _check_embeddings(self, emb: torch.Tensor) -> torch.Tensor:
        hidden = self.model.config.hidden_size
        if emb.dim() != 2 or emb.shape[1] != hidden or not emb.is_floating_point():
            raise SessionError(f"embeddings must be float (n, {hidden}), got {tuple(emb.shape)}")
        if not torch.isfinite(emb).all():
            raise SessionError("embeddings contain NaN or Inf")
        return emb.detach().to(self.model.dtype)
