"""`metronome bench engine-vs-vllm`: the native engine against vLLM on the same CPU, side by side.

Two pairs, each measured together in one process: our engine unbounded vs stock vLLM (full
attention), and our engine under `sinks_window:S:W` vs vLLM's own sliding window of S + W
tokens (the same resident KV). For each context length L, one engine of each system of a
pair is alive at once (`metronome.bench.vllm.pair`):

* **prefill**: each prefills `prefill_sessions` sessions of L tokens of real text (Hamlet),
  timed, `prefill_repeats` times in alternating order (fresh sessions each; a cell reports
  the median, and every run); vLLM then prefills the rest of the largest N (it has no
  other way to a long context), ours lengthens them with `Engine.fast_forward` (same
  blocks, same step cost);
* **decode**: `repeats` rounds; in each, at every N, both systems run `decode_steps` pure
  decode steps (every one of the first N sessions decoding one token), in alternating order
  (ours first in even rounds, vLLM first in odd), so load from elsewhere hits both alike.
  A cell reports the median over rounds of each round's median step, and the fastest step.

Then the GEMMs: torch's own best GFLOP/s (F.linear and prepacked oneDNN) for the decode
step's projection and lm_head shapes at each N, against what our step reaches in those same
GEMMs (a profiled step's GEMM time). Needs vLLM (`make vllm-install`; run from .venv-vllm).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from metronome.bench.vllm.names import OURS, SLIDING, STOCK
from metronome.kv.residency import ResidencyPolicy
from metronome.results.context import RunContext, RunRefused
from metronome.results.provenance import describe
from metronome.results.tables import md_table

NAME = "engine-vs-vllm"
# vLLM's default max_num_batched_tokens on CPU (its LLM class; arg_utils, vLLM 0.32)
VLLM_CPU_STEP_TOKENS = 4096
PAIR_TITLES = {STOCK: "unbounded: ours vs stock vLLM (full attention)",
               SLIDING: "bounded: ours `sinks_window:S:W` vs vLLM's sliding window of S + W"}


@dataclass(frozen=True)
class Config:
    sessions: tuple[int, ...] = field(default=(8, 32, 64),
                                      metadata={"help": "sessions decoding in one step (N)"})
    lengths: tuple[int, ...] = field(default=(1024, 4096),
                                     metadata={"help": "tokens of context per session (L)"})
    sink_tokens: int = field(default=4, metadata={"help": "the bound's sinks"})
    window_tokens: int = field(default=512, metadata={"help": "the bound's window"})
    # vLLM prefills every session for real (~430 tokens/s here, fp32): 32 x 4k would add
    # ~10 min per vLLM engine
    max_prefill_tokens: int = field(default=65536, metadata={
        "help": "cells with N x L over this are skipped"})
    prefill_sessions: int = field(default=8, metadata={
        "help": "sessions prefilled for real by both systems, timed"})
    prefill_repeats: int = field(default=1, metadata={
        "help": "timed prefills per system, alternating order, fresh sessions each (the "
                "table gives their medians)"})
    decode_steps: int = field(default=6, metadata={"help": "decode steps per round and N"})
    repeats: int = field(default=3, metadata={"help": "alternating rounds of decode steps"})
    block_size: int = field(default=32, metadata={
        "help": "KV block size in tokens, both systems (vLLM's CPU attention: multiples of 32)"})
    # None: each system as a user gets it (ours: EngineConfig's defaults; vLLM: its CPU
    # default of 4,096 tokens per step, no per-request cap); a number: both get it
    max_chunk_tokens: int | None = field(default=None, metadata={
        "help": "both systems' prefill chunk per session and step (unset: each system's "
                "default)"})
    max_step_tokens: int | None = field(default=None, metadata={
        "help": "both systems' tokens per step (unset: each system's default)"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(sessions=(2, 4), lengths=(256,), window_tokens=64, decode_steps=3,
                   repeats=2, prefill_sessions=2)

    def budgets(self) -> dict[str, dict[str, int]]:
        """Each system's step budget: {system: {max_chunk_tokens, max_step_tokens}} (ours
        empty when unset: the engine's defaults)."""
        ours = {name: value for name, value in (("max_chunk_tokens", self.max_chunk_tokens),
                                                ("max_step_tokens", self.max_step_tokens))
                if value is not None}
        step = VLLM_CPU_STEP_TOKENS if self.max_step_tokens is None else self.max_step_tokens
        # unset: no per-request cap (vLLM's default); the pair clamps it to max_model_len,
        # which vLLM requires and which caps nothing
        chunk = step if self.max_chunk_tokens is None else self.max_chunk_tokens
        return {"ours": ours, "vllm": {"max_chunk_tokens": chunk, "max_step_tokens": step}}

    @property
    def bound(self) -> ResidencyPolicy:
        return ResidencyPolicy.sinks_window(self.sink_tokens, self.window_tokens)

    def sessions_at(self, length: int) -> tuple[int, ...]:
        return tuple(n for n in self.sessions if n * length <= self.max_prefill_tokens)


def run(ctx: RunContext, cfg: Config) -> dict:
    import os

    import psutil
    import torch

    from metronome.bench.engine.floor import read_bandwidth_gbs
    from metronome.bench.vllm.engines import facts, load_native_model
    from metronome.bench.vllm.pair import measure_pair, pairs_needing_too_much

    torch.set_num_threads(os.cpu_count() or 1)
    model = load_native_model()
    too_big = pairs_needing_too_much(cfg, model, psutil.virtual_memory().available)
    if too_big:
        raise RunRefused("this grid does not fit this machine's memory (lower --sessions or "
                         "--max-prefill-tokens):\n  " + "\n  ".join(too_big))
    ctx.record(**facts(model))
    bandwidth_gbs = read_bandwidth_gbs()
    ctx.log(f"memory read bandwidth: {bandwidth_gbs:.1f} GB/s")
    cells = []
    for length in cfg.lengths:
        if not cfg.sessions_at(length):
            continue
        for ours_policy, vllm_kind in ((ResidencyPolicy.unbounded(), STOCK),
                                       (cfg.bound, SLIDING)):
            cells += measure_pair(cfg, model, length, ours_policy, vllm_kind, ctx.log)
            ctx.keep("cells", cells)
    rows = ratios(cells)
    _add_floor(cells, model, cfg, bandwidth_gbs)
    _plot(ctx, rows)
    return {"config": asdict(cfg), "cells": cells, "ratios": rows,
            "read_bandwidth_gbs": bandwidth_gbs, "budgets": cfg.budgets()}


def _add_floor(cells: list[dict], model, cfg: Config, bandwidth_gbs: float) -> None:
    """Each of our decode cells' memory floor (weights once + resident KV once) and its step
    as a multiple of it. A cell with the bandwidth measured next to each of its rounds
    (`round_bandwidth_gbs`) is compared round by round: the multiple is the median of each
    round's median step over the floor at that round's bandwidth, and `floor_ms` the floor at
    their median bandwidth; else `bandwidth_gbs` (the run's, measured once) for all."""
    from metronome.bench.engine.floor import decode_floor_ms

    for cell in cells:
        if cell["system"] != OURS:
            continue
        bounded = cell["pair"] == SLIDING
        resident = (min(cell["context_tokens"], cfg.sink_tokens + cfg.window_tokens)
                    if bounded else cell["context_tokens"])

        def floor_ms(gbs: float, cell=cell, resident=resident) -> float:
            return decode_floor_ms(model, cell["sessions"], resident, gbs)

        rounds_gbs = cell.get("round_bandwidth_gbs")
        # at the run's one bandwidth (a 1 GiB buffer read at the start): shown beside
        run_floor_ms = floor_ms(bandwidth_gbs)
        cell["run_floor_multiple"] = cell["step_ms_median"] / run_floor_ms
        if not rounds_gbs:
            cell["floor_ms"] = run_floor_ms
            cell["floor_multiple"] = cell["run_floor_multiple"]
            continue
        multiples = [step / floor_ms(gbs) for step, gbs
                     in zip(cell["round_medians_ms"], rounds_gbs, strict=True)]
        cell["round_floor_multiples"] = multiples
        cell["floor_ms"] = floor_ms(statistics.median(rounds_gbs))
        cell["floor_multiple"] = statistics.median(multiples)


def _has_round_bandwidth(result: dict) -> bool:
    return any(c.get("round_bandwidth_gbs") for c in result["cells"])


def _by(cells: list[dict]) -> dict:
    return {(c["pair"], c["system"], c["sessions"], c["context_tokens"]): c for c in cells}


def ratios(cells: list[dict]) -> list[dict]:
    """Our decode tokens/s over vLLM's, per cell (> 1: ours is faster)."""
    by, out = _by(cells), []
    for (pair, system, n, length), ours in sorted(by.items(), key=lambda kv: kv[0]):
        if system != OURS:
            continue
        theirs = by[(pair, pair, n, length)]
        out.append({"pair": pair, "sessions": n, "context_tokens": length,
                    "speed_ratio": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
                    "min_ratio": theirs["step_ms_min"] / ours["step_ms_min"],
                    "ours": ours, "vllm": theirs})
    return out


def _plot(ctx: RunContext, rows: list[dict]) -> None:
    plt, save = ctx.figure(ctx.out_json.stem + ".png")
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{'unb' if r['pair'] == STOCK else 'win'}\nN={r['sessions']}\n"
              f"L={r['context_tokens']:,}" for r in rows]
    ax.bar(range(len(rows)), [r["speed_ratio"] for r in rows],
           color=["tab:blue" if r["pair"] == STOCK else "tab:green" for r in rows])
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("our decode tok/s / vLLM's")
    ax.set_title("Native engine vs vLLM, same CPU, side by side (blue: unbounded vs stock; "
                 "green: sinks+window vs sliding window)", fontsize=8)
    save(fig)


def decode_lines(rows: list[dict]) -> list[str]:
    lines = []
    for pair, title in PAIR_TITLES.items():
        mine = sorted((r for r in rows if r["pair"] == pair),
                      key=lambda r: (r["context_tokens"], r["sessions"]))
        if not mine:
            continue
        table = []
        for r in mine:
            o, v = r["ours"], r["vllm"]
            rounds = (", ".join(f"{x:.0f}" for x in o["round_medians_ms"]) + " / "
                      + ", ".join(f"{x:.0f}" for x in v["round_medians_ms"]))
            floor = (f"{o['floor_ms']:.1f} ({o['floor_multiple']:.1f}x)" if "floor_ms" in o
                     else "-")
            if o.get("round_floor_multiples"):
                floor += (" rounds " + ", ".join(f"{x:.2f}x" for x in o["round_floor_multiples"])
                          + f"; {o['run_floor_multiple']:.2f}x at the run's start bandwidth")
            table.append([r["sessions"], f"{r['context_tokens']:,}",
                          f"{o['step_ms_median']:.1f} ({o['decode_tokens_per_s']:.0f})",
                          f"{v['step_ms_median']:.1f} ({v['decode_tokens_per_s']:.0f})",
                          f"**{r['speed_ratio']:.2f}x**", f"{r['min_ratio']:.2f}x", floor,
                          rounds])
        lines += [f"### {title}", "", md_table(
            ["N", "L", "ours ms/step (tok/s)", "vLLM ms/step (tok/s)",
             "ours / vLLM tok/s (medians)", "(fastest steps)",
             "memory floor ms (ours as a multiple)", "round medians ms: ours / vLLM"],
            table), ""]
    return lines


def prefill_table(cells: list[dict]) -> str:
    by, seen, rows = _by(cells), set(), []
    for (pair, system, _n, length), cell in sorted(by.items(), key=lambda kv: kv[0]):
        if system != OURS or (pair, length) in seen:
            continue
        seen.add((pair, length))
        theirs = next(c for k, c in by.items() if k[0] == pair and k[1] == pair
                      and k[3] == length)
        ours_runs = cell.get("prefill_runs_s", [cell["prefill_s"]])
        their_runs = theirs.get("prefill_runs_s", [theirs["prefill_s"]])
        each = ", ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(ours_runs, their_runs, strict=True))
        rows.append([pair, f"{length:,}", cell["prefill_sessions"], f"{cell['prefill_s']:.1f}",
                     f"{theirs['prefill_s']:.1f}",
                     f"{cell['prefill_s'] / theirs['prefill_s']:.2f}x", each])
    return md_table(["pair", "L", "sessions", "ours s", "vLLM s", "ours / vLLM time (medians)",
                     "each prefill s: ours / vLLM"], rows)


def _gflops(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def gemm_table(cells: list[dict]) -> str:
    rows = []
    for c in cells:
        g = c.get("gemm")
        if not g:
            continue
        s, p = g["profile"]["share_of_wall"], g["profile"]
        rows.append([c["pair"], g["rows"], f"{g['step_gemm_ms']:.1f}",
                     _gflops(g["achieved_gflops"]), f"{g['peak_gflops']['f_linear']:.1f}",
                     f"{g['peak_gflops']['onednn_prepacked']:.1f}",
                     _gflops(g["peak_gflops"].get("small_linear")),
                     "-" if g["share_of_peak"] is None else f"{g['share_of_peak']:.0%}",
                     f"{s['matmul']:.0%}, {s['attention']:.0%}, {s['copy_gather']:.0%}, "
                     f"{s['other_aten']:.0%}, {p['outside_aten_share']:.0%}; "
                     f"{p['aten_calls_per_step']:.0f}"])
    return md_table(["pair", "N", "step GEMM ms (profiled)", "ours GFLOP/s",
                     "torch peak: F.linear", "oneDNN prepacked", "few-row kernel",
                     "ours / best peak",
                     "profiled step: GEMMs, attention, copies, other aten, outside aten; "
                     "aten calls"], rows)


def _budget_sentence(result: dict) -> str:
    budgets = result.get("budgets")
    if not budgets:
        return ""
    ours = budgets["ours"] or "EngineConfig's defaults"
    chunk = result["config"]["max_chunk_tokens"]
    return (f"Step budgets: ours {ours}; vLLM max_num_batched_tokens "
            f"{budgets['vllm']['max_step_tokens']:,}, per-request chunk "
            f"{'uncapped' if chunk is None else chunk} "
            "(unset options: each system as a user gets it). ")


def report(result: dict) -> str:
    cfg, rows = result["config"], result["ratios"]
    worst = min(rows, key=lambda r: r["speed_ratio"]) if rows else None
    reached = [r for r in rows if r["speed_ratio"] >= 1.0]
    figures = [f"![ours / vLLM]({name})" for name in result["plots"]]
    lines = [
        f"# The native engine vs vLLM on the same CPU (`{result['command']}`)", "",
        f"Written by the command in {result['elapsed_s'] / 60:.0f} min; do not edit by hand.",
        "", describe(result["provenance"]) + " The machine is shared: read the ratios (each "
        "measured side by side), not the absolute times.", "",
        "**Workload** (the vLLM issue's decode grid): greedy, block size "
        f"{cfg['block_size']} for both. Per context length L, our engine and one vLLM engine "
        "(in-process, enforce-eager) are alive at once. Both prefill "
        f"{cfg['prefill_sessions']} sessions of L tokens of Hamlet for real (timed"
        + (f", {cfg['prefill_repeats']} times each in alternating order, fresh sessions "
           "each time: the table gives the medians" if cfg.get("prefill_repeats", 1) > 1
           else "") + "); vLLM "
        "prefills the rest of the largest N for real, ours lengthens its other sessions with "
        "`Engine.fast_forward` (same blocks, same step cost). Then "
        f"{cfg['repeats']} rounds: at each N both run {cfg['decode_steps']} pure decode steps "
        "(every session one token), ours first in even rounds, vLLM first in odd. A cell is "
        "the median of the rounds' median steps. Cells with N x L over "
        f"{cfg['max_prefill_tokens']:,} tokens are skipped. " + _budget_sentence(result)
        + (f"Memory floor of a decode step: the weights read once plus the resident KV read "
           "once at the measured read bandwidth (a 1 GiB sum on torch's threads: "
           f"{result['read_bandwidth_gbs']:.1f} GB/s at the run's start; " + (
               "then, for the floor, measured again just before and just after each of our "
               "rounds by reading the step's own weights, every projection and lm_head as "
               "the step reads it (the few-row kernel's packed copy in bf16), as float32 "
               "words: a pure read of the very pages the step reads, the better of "
               "the two taken; each round's median step is divided by the floor of its own "
               "time, and the multiple is the median over the rounds)."
               if _has_round_bandwidth(result) else "once for the run).")
           if "read_bandwidth_gbs" in result else ""), "",
        "## Decode", "", *decode_lines(rows),
    ]
    if worst:
        lines += [f"Ours is at least as fast as vLLM in {len(reached)} of {len(rows)} cells; the "
                  f"lowest ratio is {worst['speed_ratio']:.2f}x ({worst['pair']}, "
                  f"N={worst['sessions']}, L={worst['context_tokens']:,}).", ""]
    lines += [*figures, "", "## Prefill", "", prefill_table(result["cells"]), "",
              "## GEMMs: our step vs torch's peak for the same shapes", "",
              "Both sides over the same weights: every layer's projections and lm_head. "
              "torch's peak: those shapes at N rows, all in a row (weights from memory), best "
              "of 6, with F.linear, with oneDNN on prepacked weights, and (at most 8 rows in "
              "bf16 on AVX512-BF16, 24 in float32 on AVX2) with our few-row kernel, which the step "
              "uses there. Ours: their FLOPs in "
              "one profiled decode step over the profiled time of its GEMMs (attention's own "
              "matmuls are counted as attention, not here).", "", gemm_table(result["cells"]),
              ""]
    return "\n".join(lines)
