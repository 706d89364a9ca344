"""`metronome bench engine-vs-vllm`: the native engine against vLLM (4,096 tokens a step, its
CPU default) in one process: ours unbounded vs stock vLLM, ours `sinks_window:S:W` vs vLLM's
sliding window of S + W. Per L both prefill `prefill_sessions` sessions in turn (timed); at
each N their decode steps are interleaved and each of our rounds is set against its memory
floor (weights and resident KV read once at the bandwidth of the step's own pages, read
before and after the round). Derived number: our decode tokens/s over vLLM's, the lowest.
"""

from __future__ import annotations

import os
import statistics
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

from metronome.bench import systems as sy
from metronome.bench.engine.facts import BUNDLED_MODEL, engine_path
from metronome.bench.presets import Knobs, knob
from metronome.bench.steps import interleave, stats
from metronome.kv.residency import ResidencyPolicy
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived

NAME = "engine-vs-vllm"
VLLM_STEP_TOKENS = 4096  # vLLM's default max_num_batched_tokens on CPU (0.32)
OURS = "metronome"


@dataclass(frozen=True)
class Config(Knobs):
    sessions: tuple[int, ...] = knob((8, 32, 64), "sessions decoding in one step (N)")
    lengths: tuple[int, ...] = knob((1024, 4096), "tokens of context per session (L)")
    sink_tokens: int = knob(4, "the bound's sinks")
    window_tokens: int = knob(512, "the bound's window")
    vllm_mode: str = knob("default", "how vLLM runs: default (vLLM's own: compiled) or eager")
    max_prefill_tokens: int = knob(65536, "cells with N x L over this are skipped")
    prefill_sessions: int = knob(8, "sessions both systems prefill for real, timed")
    decode_steps: int = knob(6, "decode steps per round and N")
    repeats: int = knob(3, "rounds of decode steps, the order alternating")
    block_size: int = knob(32, "KV block size, both (vLLM's CPU attention: multiples of 32)")

    SMOKE = dict(sessions=(2, 4), lengths=(256,), window_tokens=64, decode_steps=3,
                 repeats=2, prefill_sessions=2, vllm_mode="eager")

    def sessions_at(self, length: int) -> list[int]:
        return [n for n in self.sessions if n * length <= self.max_prefill_tokens]


def step_pages(model) -> list[torch.Tensor]:
    """What a decode step's projections read, as float32 words where the bytes allow (a pure
    read: a bf16 sum converts every element): the few-row kernel's own copy where it runs."""
    projections = [p for layer in model.projections for p in (
        layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head_projection]
    weights = [p.small_weight if p.small is not None else p.weight for p in projections]
    return [w.reshape(-1).view(torch.float32) if w.is_contiguous() and w.element_size() <= 4
            and w.numel() * w.element_size() % 4 == 0 else w for w in weights]


def read_gbs(pages: list[torch.Tensor]) -> float:
    """The best of 3 reads of `pages` (after one untimed), in GB/s."""
    seconds = interleave({"read": lambda: [t.sum() for t in pages]}, 3)["read"]
    return sum(t.numel() * t.element_size() for t in pages) / min(map(min, seconds)) / 1e9


def floor_ms(model, pages, sessions: int, resident_tokens: int, gbs: float) -> float:
    """ms to read the step's weights (`pages`) once and its sessions' resident KV once."""
    kv = sessions * resident_tokens * model.config.kv_bytes_per_token(model.dtype)
    return (sum(t.numel() * t.element_size() for t in pages) + kv) / (gbs * 1e9) * 1e3


def pair(cfg: Config, model, length: int, bounded: bool, log) -> list[dict]:
    """Ours and vLLM at `length`: prefills, then decode steps at every N; a row per N."""
    kind, unbounded = "vllm_sliding_window" if bounded else "vllm", ResidencyPolicy.unbounded()
    bound = ResidencyPolicy.sinks_window(cfg.sink_tokens, cfg.window_tokens)
    sessions, added = cfg.sessions_at(length), 2 * cfg.decode_steps * len(cfg.sessions) * (
        cfg.repeats + 1) + 64  # each pool: the history and the decode steps, or the window
    per_session = (cfg.sink_tokens + cfg.window_tokens + min(length, VLLM_STEP_TOKENS) + 64
                   if bounded else length + added)  # and vLLM's reserve for tokens in flight
    pool = -(-max(sessions) * per_session // cfg.block_size) * cfg.block_size
    max_len = length + added + 1024
    budget = {"max_step_tokens": VLLM_STEP_TOKENS,  # its chunk: at most max_len (its rule)
              "max_chunk_tokens": min(VLLM_STEP_TOKENS, max_len), "mode": cfg.vllm_mode}
    log(f"L={length:,} {'bounded' if bounded else 'unbounded'} vs {kind}: pools of {pool:,}")
    theirs = sy.vllm_engine(kind, bound, pool, max_len, max(cfg.sessions), cfg.block_size,
                            **budget)
    threads = {kind: torch.get_num_threads(), OURS: os.cpu_count()}
    ours = sy.native(model, pool, cfg.block_size)
    engines, policies = {OURS: ours, kind: theirs}, {OURS: bound if bounded else unbounded,
                                                     kind: unbounded}
    sids = {name: sy.open_sessions(e, max(sessions), policies[name])
            for name, e in engines.items()}
    ids, pages, rows = sy.text_ids(2 * length), step_pages(model), []
    try:
        k = cfg.prefill_sessions
        prefills = {name: stats(t)["median_ms"] / 1e3 for name, t in interleave({
            name: sy.Prefill(e, sids[name][:k], length, ids, threads[name])
            for name, e in engines.items()}, 1, warmup=0).items()}
        for sid in sids[OURS][k:]:
            assert ours.fast_forward(sid, length), "pool sized too small"
        if sids[kind][k:]:  # vLLM has no other way to a long context: untimed
            sy.Prefill(theirs, sids[kind][k:], length, ids, threads[kind]).step()
        for n in sessions:
            gbs = []

            @contextmanager
            def probed(name: str, gbs=gbs):
                before = read_gbs(pages) if name == OURS else None
                yield
                if name == OURS:
                    gbs.append(max(before, read_gbs(pages)))

            decodes = {name: sy.Decode(e, sids[name][:n], cfg.repeats * cfg.decode_steps + 1,
                                       threads[name]) for name, e in engines.items()}
            s = {name: stats(t) for name, t in interleave(
                decodes, cfg.repeats, cfg.decode_steps, around=probed).items()}
            for decode in decodes.values():
                decode.finish()
            resident = min(length, cfg.sink_tokens + cfg.window_tokens) if bounded else length
            floors = [floor_ms(model, pages, n, resident, g) for g in gbs]
            rows.append({"pair": "bounded" if bounded else "unbounded", "vllm": kind,
                         "sessions": n, "context_tokens": length, "ours_ms": s[OURS]["median_ms"],
                         "vllm_ms": s[kind]["median_ms"],
                         "speed_ratio": s[kind]["median_ms"] / s[OURS]["median_ms"],
                         "floor_ms": floor_ms(model, pages, n, resident, statistics.median(gbs)),
                         "floor_multiple": statistics.median(
                             m / f for m, f in zip(s[OURS]["round_medians_ms"], floors,
                                                   strict=True)),
                         "read_gbs": gbs, "prefill_s": [prefills[OURS], prefills[kind]],
                         "prefill_ratio": prefills[OURS] / prefills[kind]})
            log(f"  N={n}: ours {rows[-1]['ours_ms']:.1f} ms, vLLM {rows[-1]['vllm_ms']:.1f} ms")
        return rows
    finally:
        theirs.shutdown()


def run(ctx: RunContext, cfg: Config) -> dict:
    import vllm

    torch.set_num_threads(os.cpu_count())
    model = sy.load_model()
    ctx.record(model=BUNDLED_MODEL, dtype=sy.DTYPE, vllm=vllm.__version__,
               vllm_mode=cfg.vllm_mode, engine_path=
               f"vLLM {vllm.__version__} (CPU, in-process) vs native {engine_path('fast', model)}")
    rows = []
    for length in cfg.lengths:
        for bounded in (False, True) if cfg.sessions_at(length) else ():
            rows += pair(cfg, model, length, bounded, ctx.log)
            ctx.keep("rows", rows)
    low = min(rows, key=lambda r: r["speed_ratio"], default=None)
    return REPORT.finish(ctx, {
        "config": asdict(cfg), "rows": rows, "derived": derived(
            f"our decode tokens/s over vLLM's, the lowest of {len(rows)} cells ({low['pair']}, "
            f"N={low['sessions']}, L={low['context_tokens']})" if low else "no cell ran",
            low and low["speed_ratio"])})


REPORT = Report("The native engine vs vLLM on the same CPU", spec=".2f", tables=(
    Table("Decode (ms: medians of the rounds' medians; floor: ours' memory floor) and prefill "
          "(s: ours, vLLM)", "rows"),),
    plots=(Plot("{stem}.png", "rows", x="sessions", ys=("speed_ratio", "floor_multiple"),
                series="pair"),))
report = REPORT.markdown
