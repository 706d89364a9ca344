"""`metronome bench vllm`: Metronome's bound inside vLLM, side by side in one run.

1. **Decode steps** at N sessions x L tokens of context: stock vLLM (full attention), vLLM
   with its own plain sliding window (`layer_types` = sliding, W + S tokens: the same
   resident KV), vLLM + the Metronome bound (`sinks_window:S:W`, the plugin) and the native
   engine with the same bound. Each engine prefills the largest N sessions to L once, then
   times pure decode steps (every one of the first N sessions decoding) at each N.
2. **The streaming workload**: sessions of 16 input + 4 output tokens per 1 s frame in a
   small KV pool. Stock vLLM (its scheduler alone) against Metronome on vLLM (the beat and
   its deadlines) unbounded and bounded, every arm counted by one rule
   (`metronome.bench.vllm.stream`).

Everything runs in one process, one engine at a time (vLLM in-process; CPU threads are the
machine's). Needs vLLM (`make vllm-install`; run from .venv-vllm).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from metronome.bench.vllm.names import LABELS, NATIVE, PLUGIN, SLIDING, STOCK
from metronome.kv.residency import ResidencyPolicy
from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.results.tables import fmt, md_table, ratio

NAME = "vllm"


@dataclass(frozen=True)
class Config:
    sessions: tuple[int, ...] = field(default=(8, 32, 64),
                                      metadata={"help": "sessions decoding in one step (N)"})
    lengths: tuple[int, ...] = field(default=(1024, 4096),
                                     metadata={"help": "tokens of context per session (L)"})
    sink_tokens: int = field(default=4, metadata={"help": "the bound's sinks"})
    window_tokens: int = field(default=512, metadata={"help": "the bound's window"})
    # Prefill is compute-bound on a CPU (~430 tokens/s here: 0.27 GFLOP a token)
    max_prefill_tokens: int = field(default=65536, metadata={
        "help": "cells whose N x L exceeds this are skipped (64 x 4k: ~10 min per engine)"})
    decode_steps: int = field(default=8, metadata={"help": "timed decode steps per cell"})
    block_size: int = field(default=32, metadata={
        "help": "KV block size in tokens (vLLM's CPU attention takes multiples of 32)"})
    # native first: vLLM sets torch's threads to 1 in its process (the native engine takes
    # them back)
    engines: tuple[str, ...] = field(default=(NATIVE, STOCK, SLIDING, PLUGIN),
                                     metadata={"help": "engines of the decode grid, in order"})
    # The workload is 16 sessions in 26,880 tokens. On a 2-core CPU (fp32) vLLM
    # answers 8 such sessions at p50 1.5 s already: a quarter of the sessions in a quarter
    # of the pool has the same fill time, a load the machine can serve.
    stream_sessions: int = field(default=4, metadata={"help": "streaming sessions"})
    stream_duration_s: float = field(default=200.0, metadata={
        "help": "length of the streaming workload"})
    stream_period_s: float = field(default=1.0, metadata={
        "help": "frame period, and each frame's deadline"})
    stream_tokens_in: int = field(default=16, metadata={"help": "input tokens per frame"})
    stream_tokens_out: int = field(default=4, metadata={"help": "output tokens per frame"})
    stream_pool_tokens: int = field(default=6720, metadata={
        "help": "the streaming engines' KV pool in tokens"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(sessions=(2, 4), lengths=(256,), window_tokens=64, decode_steps=3,
                   stream_sessions=4, stream_duration_s=12.0, stream_pool_tokens=1024)

    @property
    def bound(self) -> ResidencyPolicy:
        return ResidencyPolicy.sinks_window(self.sink_tokens, self.window_tokens)

    def sessions_at(self, length: int) -> tuple[int, ...]:
        return tuple(n for n in self.sessions if n * length <= self.max_prefill_tokens)


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.bench.vllm.decode import decode_grid
    from metronome.bench.vllm.engines import facts, load_native_model
    from metronome.bench.vllm.stream import stream_metronome, stream_stock

    model = load_native_model()
    ctx.record(**facts(model))
    ctx.console.rule("decode steps")
    cells = decode_grid(cfg, model, ctx.log)
    ctx.keep("decode", cells)
    _plot(ctx, cells)
    ctx.console.rule("streaming workload")
    stream = []
    for run_one in (lambda: stream_stock(cfg, ctx.log),
                    lambda: stream_metronome(cfg, "unbounded", ctx.log),
                    lambda: stream_metronome(cfg, str(cfg.bound), ctx.log)):
        stream.append(run_one())
        ctx.keep("stream", stream)
    return {"config": asdict(cfg), "labels": LABELS, "decode": cells, "stream": stream}


def _plot(ctx: RunContext, cells: list[dict]) -> None:
    plt, save = ctx.figure(ctx.out_json.stem + ".png")
    lengths = sorted({c["context_tokens"] for c in cells})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.6), squeeze=False)
    for ax, length in zip(axes[0], lengths, strict=True):
        for engine, label in LABELS.items():
            pts = sorted((c["sessions"], c["step_ms_median"]) for c in cells
                         if c["engine"] == engine and c["context_tokens"] == length)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set_title(f"decode step, L = {length:,} tokens")
        ax.set_xlabel("sessions decoding")
        ax.set_ylabel("ms / step (median)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    save(fig)


def decode_table(cells: list[dict], labels: dict[str, str]) -> str:
    engines = [e for e in labels if any(c["engine"] == e for c in cells)]
    keys = sorted({(c["sessions"], c["context_tokens"]) for c in cells},
                  key=lambda k: (k[1], k[0]))
    by = {(c["engine"], c["sessions"], c["context_tokens"]): c for c in cells}
    rows = []
    for n, length in keys:
        row = [n, f"{length:,}"]
        for e in engines:
            c = by.get((e, n, length))
            row.append("-" if c is None else
                       f"{c['step_ms_median']:.1f} ({c['decode_tokens_per_s']:.0f})")
        plugin, sliding = by.get((PLUGIN, n, length)), by.get((SLIDING, n, length))
        row.append(ratio(plugin and plugin["step_ms_median"],
                         sliding and sliding["step_ms_median"]))
        rows.append(row)
    return md_table(["N", "L", *(f"{labels[e]} ms/step (tok/s)" for e in engines),
                     "plugin / sliding window"], rows)


def stream_table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        first = r.get("first_stall_arrival_s", r["first_unanswered_arrival_s"])
        rows.append([r["run"], r["frames"], r["never_answered"], fmt(first, ".1f"),
                     fmt(r["stalled_kv_frames"], "d"), fmt(r["goodput"], ".3f"),
                     fmt(r["latency_ms_p50"], ".0f"), fmt(r["latency_ms_p95"], ".0f"),
                     fmt(r.get("health_critical_first_s"), ".1f")])
    return md_table(["run", "frames due", "never answered", "first stall / unanswered (s)",
                     "stalled_kv", "goodput", "p50 ms", "p95 ms", "health critical from (s)"],
                    rows)


def report(result: dict) -> str:
    cfg, prov = result["config"], result["provenance"]
    resident = cfg["sink_tokens"] + cfg["window_tokens"]
    bound = f"sinks_window:{cfg['sink_tokens']}:{cfg['window_tokens']}"
    figures = [f"![decode step time]({name})" for name in result["plots"]]
    lines = [
        "# Metronome on vLLM: the bound's step cost and the streaming deadlock", "",
        f"Command: `{result['command']}` (from .venv-vllm; needs `make vllm-install`); one "
        f"engine at a time, in one process; total {result['elapsed_s'] / 60:.1f} min.", "",
        describe(prov), "",
        "## Decode step time", "",
        f"N sessions, each with L tokens of context, all decoding (median of "
        f"{cfg['decode_steps']} steps after the first). The bounded engines keep {bound} "
        f"({resident} tokens) resident per session; the stock sliding window keeps {resident} "
        "(the same resident KV; vLLM's `layer_types`: every layer sliding). Stock vLLM "
        "attends all L. The native engine reaches L with `fast_forward` (KV written without "
        "the model: the same step cost, no prefill).", "",
        decode_table(result["decode"], result["labels"]), "", *figures, "",
        "## The streaming workload", "",
        f"{cfg['stream_sessions']} sessions, {cfg['stream_tokens_in']} input + "
        f"{cfg['stream_tokens_out']} output tokens per {cfg['stream_period_s']:g} s frame, "
        f"{cfg['stream_duration_s']:.0f} s, KV pool of {cfg['stream_pool_tokens']:,} tokens. "
        f"Deadline: one frame period ({cfg['stream_period_s']:g} s). *Stock vLLM* is vLLM's "
        "scheduler alone (a session's next chunk goes in when its last one is done, as "
        "`AsyncLLM`'s streaming input does); a frame is answered when its chunk is. "
        "*Metronome on vLLM* is the same engine under the beat, which answers a frame on "
        "time with its output or says why not (stalled_kv: no KV block).", "",
        "Both arms are counted by one rule. Frames due: those that arrived at least one "
        "deadline before the arm stopped. Never answered: frames due that got no answer at "
        "all. Goodput: frames due whose work was done with their output within the "
        "deadline, over frames due. Latency: of the frames due that were answered.", "",
        stream_table(result["stream"]), "",
    ]
    return "\n".join(lines)
