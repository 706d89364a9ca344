"""The quality experiment's measurements on the engine: (i) turn-based NLL of the text tokens
and (ii) free-running generation, then its NLL under the recompute-window scorer. Owns the
engines it builds; hands back what it measured as `TurnBasedNll` and `FreeRunningText`."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, replace

import torch

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.sampling import SamplingParams
from metronome.engine.session import SessionSpec
from metronome.engine.types import StepOutput, WorkStatus
from metronome.experiments.quality.plan import (
    BLOCK_SIZE,
    FRAME_TOKENS,
    POLICIES,
    RECOMPUTE,
    REPLY_TOKENS,
    SCORE_CHUNK_TOKENS,
    SCORE_SESSIONS,
    SEGMENT_TOKENS,
    Config,
    engine_policies,
    slide_position,
)
from metronome.model.llama import LlamaModel
from metronome.results.context import RunContext
from metronome.stream import Stream

PositionNll = list[tuple[int, float]]  # (stream position, NLL nats) per scored token


@dataclass(frozen=True)
class TurnBasedNll:
    """(i) as measured: per policy, the NLL of every scored text token."""

    by_policy: dict[str, PositionNll]

    @property
    def last_position(self) -> int:
        return max(p for pairs in self.by_policy.values() for p, _ in pairs)


@dataclass(frozen=True)
class FreeRunningText:
    """(ii) as measured: per policy the generated tokens (the prompt excluded) and their NLL
    under the reference scorer; `human` is the play's own text over the same span."""

    prompt_tokens: int
    first_position: int  # first measured stream position (the window has slid past 0)
    generated: dict[str, list[int]]
    reference_nll: dict[str, PositionNll]
    human: list[int]

    @property
    def first_index(self) -> int:
        """The first measured token's index into each generated list."""
        return self.first_position - self.prompt_tokens


class NllRecorder:
    """Per-token NLL of one session's submitted tokens, appended to a policy's list.

    Logits row i of a step predicts the token after input i, so the first token of a chunk
    is predicted by the last row of the session's previous step (maybe a fed-back reply).
    Only tokens given a stream position are scored; the rest are context.
    """

    def __init__(self, out: PositionNll) -> None:
        self.out = out  # (stream position, nll nats), shared by a policy's fresh sessions
        self.expected: deque[tuple[int, int | None]] = deque()  # (token id, position | None)
        self.last_row: torch.Tensor | None = None  # (vocab,) logits of the previous step

    def expect(self, token_ids: list[int], positions: list[int | None]) -> None:
        self.expected.extend(zip(token_ids, positions, strict=True))

    def on_step(self, out: StepOutput, session_id: str) -> None:
        logits = out.logits[session_id]  # (input_tokens, vocab) float32
        consumed = out.consumed_tokens[session_id]
        carried = out.input_tokens[session_id] - consumed  # its own token written back, first
        assert 0 <= carried <= 1, out
        items = [self.expected.popleft() for _ in range(consumed)]
        scored = [(carried + i, tok, pos) for i, (tok, pos) in enumerate(items)
                  if pos is not None and (carried + i > 0 or self.last_row is not None)]
        if scored:
            rows = torch.stack([logits[i - 1] if i else self.last_row for i, _, _ in scored])
            targets = torch.tensor([tok for _, tok, _ in scored])
            nll = -rows.log_softmax(-1).gather(1, targets[:, None])[:, 0]
            self.out.extend(zip([pos for _, _, pos in scored], nll.tolist(), strict=True))
        self.last_row = logits[-1].clone()


def drain(engine: Engine, recorders: dict[str, NllRecorder],
          new_ids: dict[str, list[int]], until_sampled: str | None = None) -> None:
    """Step until the engine is idle (or until a step in which session `until_sampled`
    sampled a token)."""
    while engine.has_work:
        out = engine.step()
        for sid, status in out.status.items():
            if status is not WorkStatus.OK:  # pools are sized for every session: a bug
                raise RuntimeError(f"session {sid}: {status}")
            if sid in recorders:
                recorders[sid].on_step(out, sid)
            new_ids[sid].extend(out.new_token_ids[sid])
        if until_sampled is not None and out.new_token_ids.get(until_sampled):
            return


def quality_engine(model: LlamaModel, pool_tokens: int, max_chunk_tokens: int) -> Engine:
    """An engine whose chunk limit lets a fresh recompute session prefill in one step: on
    this CPU a decode step costs about as much as reading the weights once, so fewer,
    larger steps save minutes (chunking never changes what a query sees)."""
    return Engine(model, EngineConfig(
        block_size=BLOCK_SIZE, pool_tokens=pool_tokens, max_chunk_tokens=max_chunk_tokens,
        max_step_tokens=max(4096, max_chunk_tokens)))



def turn_based(ctx: RunContext, model: LlamaModel, setup: Config,
               text_ids: list[int]) -> TurnBasedNll:
    """NLL of every text token (after the first) per policy, keyed by stream position.

    Dense runs in its own engine: batched with the bounded sessions it would pad their
    context to its own 20k tokens in every step. recompute_window's fresh sessions run
    beside the bounded ones (similar context length)."""
    w = setup.turn_window_tokens
    num_frames = setup.text_tokens // FRAME_TOKENS
    stream_tokens = num_frames * (FRAME_TOKENS + REPLY_TOKENS)
    dense_engine = quality_engine(model, stream_tokens + 4 * BLOCK_SIZE, FRAME_TOKENS)
    bounded_engine = quality_engine(model, 8 * (w + FRAME_TOKENS + 4 * BLOCK_SIZE),
                                    w + FRAME_TOKENS)
    nll: dict[str, PositionNll] = {name: [] for name in POLICIES}
    # each engine's recorders by its own session ids (ids of the two engines may coincide)
    dense_recorders: dict[str, NllRecorder] = {}
    bounded_recorders: dict[str, NllRecorder] = {}
    sessions: list[tuple[Engine, str, NllRecorder]] = []
    for name, policy in engine_policies(w).items():
        engine, recorders = ((bounded_engine, bounded_recorders) if policy.bounded
                             else (dense_engine, dense_recorders))
        sid = engine.open_session(Stream.of(SessionSpec(policy, return_logits=True,
                                                        stop_token_ids=())))
        recorders[sid] = NllRecorder(nll[name])
        sessions.append((engine, sid, recorders[sid]))
    history: list[int] = []  # recompute_window's own stream: text and its own replies
    with ctx.progress("quality (i) turn-based frames", num_frames) as advance:
        for k in range(num_frames):
            chunk = text_ids[k * FRAME_TOKENS:(k + 1) * FRAME_TOKENS]
            positions = [k * (FRAME_TOKENS + REPLY_TOKENS) + i for i in range(FRAME_TOKENS)]
            for engine, sid, recorder in sessions:
                engine.submit(sid, chunk, max_new_tokens=REPLY_TOKENS)
                recorder.expect(chunk, positions)
            tail = history[-w:]
            rid = bounded_engine.open_session(Stream.of(SessionSpec(return_logits=True,
                                                                    stop_token_ids=())))
            bounded_engine.submit(rid, tail + chunk, max_new_tokens=REPLY_TOKENS)
            bounded_recorders[rid] = NllRecorder(nll[RECOMPUTE])
            bounded_recorders[rid].expect(tail + chunk, [None] * len(tail) + positions)
            replies: dict[str, list[int]] = defaultdict(list)
            drain(bounded_engine, bounded_recorders, replies)
            drain(dense_engine, dense_recorders, defaultdict(list))
            history += chunk + replies[rid]
            bounded_engine.close(rid)
            del bounded_recorders[rid]
            advance()
    return TurnBasedNll(nll)


def free_running(ctx: RunContext, model: LlamaModel, setup: Config,
                 prompt: list[int]) -> dict[str, list[int]]:
    """Generated tokens per policy (the prompt excluded), all from one batched engine.

    Per segment of SEGMENT_TOKENS: recompute_window's fresh session is prefilled alone in
    one step (the others wait with no budget, so their queries are not padded to its chunk
    against dense's context), then every session generates the segment together."""
    w = setup.free_window_tokens
    needed = slide_position(w) - len(prompt) + setup.measured_tokens
    num_segments = -(-needed // SEGMENT_TOKENS)
    total_tokens = len(prompt) + num_segments * SEGMENT_TOKENS
    engine = quality_engine(model, total_tokens + 8 * (w + SEGMENT_TOKENS + 4 * BLOCK_SIZE),
                            max(w, len(prompt)))
    sampling = SamplingParams(setup.temperature, setup.top_p, seed=ctx.seed)
    # common random numbers: every engine session draws from the same seeded stream
    sids = {name: engine.open_session(Stream.of(SessionSpec(policy, sampling,
                                                            stop_token_ids=())))
            for name, policy in engine_policies(w).items()}
    generated: dict[str, list[int]] = defaultdict(list)
    recomputed: list[int] = []
    with ctx.progress("quality (ii) free-running segments", num_segments) as advance:
        for seg in range(num_segments):
            seed = ctx.seed * 10_000 + seg  # a fresh session's generator restarts: new seed
            rid = engine.open_session(Stream.of(SessionSpec(
                sampling=replace(sampling, seed=seed), stop_token_ids=())))
            engine.submit(rid, (prompt + recomputed)[-w:], max_new_tokens=SEGMENT_TOKENS)
            drain(engine, {}, generated, until_sampled=rid)
            for sid in sids.values():
                engine.submit(sid, prompt if seg == 0 else None, max_new_tokens=SEGMENT_TOKENS)
            drain(engine, {}, generated)
            recomputed += generated.pop(rid)
            engine.close(rid)
            advance()
    return {name: generated[sid] for name, sid in sids.items()} | {RECOMPUTE: recomputed}


def reference_nll(ctx: RunContext, model: LlamaModel, streams: dict[str, list[int]],
                  first_position: int, window_tokens: int) -> dict[str, PositionNll]:
    """NLL of each stream from `first_position` on under the recompute-window scorer: every
    SCORE_CHUNK_TOKENS chunk by a fresh session given the W tokens before it."""
    jobs = [(name, start) for name, stream in streams.items()
            for start in range(first_position, len(stream), SCORE_CHUNK_TOKENS)]
    chunk_tokens = window_tokens + SCORE_CHUNK_TOKENS
    engine = quality_engine(model, SCORE_SESSIONS * (chunk_tokens + 2 * BLOCK_SIZE),
                            chunk_tokens)
    nll: dict[str, PositionNll] = {name: [] for name in streams}
    with ctx.progress("quality (ii) reference scoring", len(jobs)) as advance:
        for g in range(0, len(jobs), SCORE_SESSIONS):
            recorders = {}
            for name, start in jobs[g:g + SCORE_SESSIONS]:
                stream = streams[name]
                context = stream[start - window_tokens:start]
                chunk = stream[start:start + SCORE_CHUNK_TOKENS]
                sid = engine.open_session(Stream.of(SessionSpec(return_logits=True,
                                                                stop_token_ids=())))
                engine.submit(sid, context + chunk)
                recorders[sid] = NllRecorder(nll[name])
                recorders[sid].expect(context + chunk, [None] * len(context)
                                      + list(range(start, start + len(chunk))))
            drain(engine, recorders, defaultdict(list))
            for sid in recorders:
                engine.close(sid)
            advance(len(recorders))
    return nll


def score_free_running(ctx: RunContext, model: LlamaModel, setup: Config,
                       prompt: list[int], generated: dict[str, list[int]],
                       text_ids: list[int]) -> FreeRunningText:
    """Each policy's stream (prompt + generated) scored from the first measured position on;
    the play's text after the prompt, as long as the generated text, beside it."""
    first = slide_position(setup.free_window_tokens)
    streams = {name: prompt + tokens for name, tokens in generated.items()}
    ref = reference_nll(ctx, model, streams, first, setup.free_window_tokens)
    human = text_ids[len(prompt):len(prompt) + len(generated["dense"])]
    return FreeRunningText(len(prompt), first, generated, ref, human)
