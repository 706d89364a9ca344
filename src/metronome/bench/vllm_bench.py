"""`metronome bench vllm`: Metronome's bound inside vLLM, side by side in one run.

1. **Decode and chunk steps** at N sessions x L tokens of context: stock vLLM (full
   attention), vLLM with its own plain sliding window (`layer_types` = sliding, S + W
   tokens: the same resident KV), vLLM + the Metronome bound (`sinks_window:S:W`, the
   plugin) and the native engine with the same bound. Per L, the systems of a group are
   alive together with the largest N sessions at L, and take turns in rotating order
   through `repeats` rounds of pure decode steps and chunk steps (every session feeds a
   16-token chunk of real text: the streaming workload's input step) at each N
   (`metronome.bench.vllm.decode`).
2. **The streaming workload**: sessions of 16 input + 4 output tokens per 1 s frame in a
   small KV pool. vLLM's scheduler alone (full attention, and its own sliding window of
   S + W) against Metronome on vLLM (the beat and its deadlines) unbounded and bounded,
   every arm counted by one rule from its own frame records
   (`metronome.bench.vllm.stream`).

Everything runs in one process (vLLM in-process; CPU threads are the machine's). Needs vLLM
(`make vllm-install`; run from .venv-vllm).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from metronome.bench.vllm.names import LABELS, NATIVE, PLUGIN, SLIDING, STOCK, STREAM_ARMS
from metronome.kv.residency import ResidencyPolicy
from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.results.tables import fmt, md_table, ratio

NAME = "vllm"
PARTS = ("steps", "stream")
STREAM_PHASES = ("random", "even")


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
    decode_steps: int = field(default=6, metadata={
        "help": "timed decode steps per system, round and N"})
    chunk_tokens: int = field(default=16, metadata={
        "help": "tokens each session feeds in a chunk step"})
    chunk_steps: int = field(default=4, metadata={
        "help": "timed chunk steps per system, round and N"})
    repeats: int = field(default=3, metadata={"help": "rounds, in rotating system order"})
    max_step_tokens: int = field(default=1024, metadata={
        "help": "every system's tokens per step (holds N x chunk_tokens at N = 64); vLLM's "
                "bounded engines reserve this much per session for tokens in flight"})
    block_size: int = field(default=32, metadata={
        "help": "KV block size in tokens (vLLM's CPU attention takes multiples of 32)"})
    # the systems alive together at one L; the pools of all four at N = 64 (~17 GB in fp32)
    # would not fit this machine, so stock vLLM (the largest) runs on its own
    engine_groups: tuple[str, ...] = field(
        default=(STOCK, f"{NATIVE}+{SLIDING}+{PLUGIN}"),
        metadata={"help": "groups of systems measured together (interleaved, '+'-joined), "
                          "in order"})
    # The workload is 16 sessions in 26,880 tokens. On a 2-core CPU (fp32) vLLM
    # answers 8 such sessions at p50 1.5 s already: a quarter of the sessions in a quarter
    # of the pool has the same fill time, a load the machine can serve.
    parts: tuple[str, ...] = field(default=PARTS, metadata={
        "help": "what to measure: steps (decode/chunk grid), stream (the workload)"})
    stream_arms: tuple[str, ...] = field(default=STREAM_ARMS, metadata={
        "help": "streaming arms: stock, sliding_window (vLLM's scheduler), unbounded, "
                "bounded (Metronome on vLLM), native (the native engine, its defaults)"})
    stream_sessions: tuple[int, ...] = field(default=(4, 8), metadata={
        "help": "streaming sessions (each count runs every arm)"})
    stream_duration_s: float = field(default=200.0, metadata={
        "help": "length of the streaming workload"})
    stream_period_s: float = field(default=1.0, metadata={
        "help": "frame period, and each frame's deadline"})
    stream_tokens_in: int = field(default=16, metadata={"help": "input tokens per frame"})
    stream_tokens_out: int = field(default=4, metadata={"help": "output tokens per frame"})
    stream_pool_tokens: int = field(default=6720, metadata={
        "help": "the streaming engines' KV pool in tokens"})
    stream_phases: str = field(default="random", metadata={
        "help": "when each session's frames fall in the period, the same for every arm: "
                "random (seeded uniform: frames of different sessions collide at times) or "
                "even (evenly spaced)"})

    def __post_init__(self) -> None:
        if self.stream_phases not in STREAM_PHASES:
            raise ValueError(f"stream_phases must be one of {', '.join(STREAM_PHASES)}, got "
                             f"{self.stream_phases!r}")

    @classmethod
    def smoke(cls) -> Config:
        return cls(sessions=(2, 4), lengths=(256,), window_tokens=64, decode_steps=3,
                   chunk_steps=2, repeats=2, max_step_tokens=256, stream_sessions=(4,),
                   stream_duration_s=12.0, stream_pool_tokens=1024)

    @property
    def groups(self) -> list[tuple[str, ...]]:
        """`engine_groups`, each a tuple of systems (checked against the known ones)."""
        groups = [tuple(g.split("+")) for g in self.engine_groups]
        unknown = {e for g in groups for e in g} - set(LABELS)
        if unknown:
            raise ValueError(f"unknown systems {sorted(unknown)}; known: {', '.join(LABELS)}")
        return groups

    @property
    def bound(self) -> ResidencyPolicy:
        return ResidencyPolicy.sinks_window(self.sink_tokens, self.window_tokens)

    def sessions_at(self, length: int) -> tuple[int, ...]:
        return tuple(n for n in self.sessions if n * length <= self.max_prefill_tokens)


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.bench.vllm.decode import decode_grid
    from metronome.bench.vllm.engines import facts, load_native_model
    from metronome.bench.vllm.stream import run_arm_isolated
    from metronome.vllm.kernel import KERNEL

    for name, given, known in (("parts", cfg.parts, PARTS),
                               ("stream arms", cfg.stream_arms, STREAM_ARMS)):
        if set(given) - set(known):
            raise ValueError(f"unknown {name} {sorted(set(given) - set(known))}; "
                             f"known: {', '.join(known)}")
    model = load_native_model()
    ctx.record(**facts(model))
    ctx.record(plugin_attention="the in-place kernel (metronome.vllm.kernel)"
               if KERNEL.module() is not None else f"the gather path ({KERNEL.reason()})")
    cells, stream = [], []
    if "steps" in cfg.parts:
        ctx.console.rule("decode and chunk steps")
        cells = decode_grid(cfg, model, ctx.log)
        ctx.keep("decode", cells)
        _plot(ctx, cells)
    if "stream" in cfg.parts:
        ctx.console.rule("streaming workload (each arm in a fresh process)")
        for n in cfg.stream_sessions:
            for arm in cfg.stream_arms:
                ctx.log(f"streaming: {n} sessions, {arm}")
                stream.append(run_arm_isolated(cfg, n, arm))
                ctx.keep("stream", stream)
    return {"config": asdict(cfg), "labels": LABELS, "decode": cells, "stream": stream}


def _plot(ctx: RunContext, cells: list[dict]) -> None:
    plt, save = ctx.figure(ctx.out_json.stem + ".png")
    panels = sorted({(c["step"], c["context_tokens"]) for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (step, length) in zip(axes[0], panels, strict=True):
        for engine, label in LABELS.items():
            pts = sorted((c["sessions"], c["step_ms_median"]) for c in cells
                         if c["engine"] == engine and c["context_tokens"] == length
                         and c["step"] == step)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
        ax.set_title(f"{step} step, L = {length:,} tokens")
        ax.set_xlabel("sessions in the step")
        ax.set_ylabel("ms / step (median of rounds)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    save(fig)


def step_table(cells: list[dict], labels: dict[str, str], step: str) -> str:
    cells = [c for c in cells if c["step"] == step]
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
                       f"{c['step_ms_median']:.1f} ({c['tokens_per_s']:.0f})")
        plugin, sliding = by.get((PLUGIN, n, length)), by.get((SLIDING, n, length))
        row.append(ratio(plugin and plugin["step_ms_median"],
                         sliding and sliding["step_ms_median"]))
        rows.append(row)
    return md_table(["N", "L", *(f"{labels[e]} ms/step (tok/s)" for e in engines),
                     "plugin / sliding window"], rows)


def stream_table(runs: list[dict]) -> str:
    rows = []
    for r in runs:
        rows.append([r.get("sessions", "-"), r["run"], r["frames"], r["never_answered"],
                     fmt(r.get("first_stall_arrival_s"), ".1f"),
                     fmt(r["first_unanswered_arrival_s"], ".1f"),
                     fmt(r["stalled_kv_frames"], "d"), fmt(r["goodput"], ".3f"),
                     fmt(r["latency_ms_p50"], ".0f"), fmt(r["latency_ms_p95"], ".0f"),
                     fmt(r.get("health_critical_first_s"), ".1f")])
    return md_table(["sessions", "run", "frames due", "never answered", "first stall (s)",
                     "first unanswered (s)", "stalled_kv", "goodput", "p50 ms", "p95 ms",
                     "health critical from (s)"], rows)


def report(result: dict) -> str:
    cfg, prov = result["config"], result["provenance"]
    resident = cfg["sink_tokens"] + cfg["window_tokens"]
    bound = f"sinks_window:{cfg['sink_tokens']}:{cfg['window_tokens']}"
    figures = [f"![step time]({name})" for name in result["plots"]]
    groups = "; ".join(" + ".join(result["labels"][e] for e in g.split("+"))
                       for g in cfg["engine_groups"])
    lines = [
        "# Metronome on vLLM: the bound's step cost and the streaming workload", "",
        f"Command: `{result['command']}` (from .venv-vllm; needs `make vllm-install`); in one "
        f"process; total {result['elapsed_s'] / 60:.1f} min.", "",
        describe(prov), "",
    ]
    steps = [
        "## Decode and chunk steps", "",
        f"N sessions, each with L tokens of context. Decode: every session feeds one token "
        f"and samples one. Chunk: every session feeds {cfg['chunk_tokens']} tokens of real "
        "text and samples one (the streaming workload's input step). The bounded engines "
        f"keep {bound} ({resident} tokens) resident per session; vLLM's sliding window keeps "
        f"{resident} (the same resident KV; `layer_types`: every layer sliding); stock vLLM "
        "attends all L. The native engine reaches L with `fast_forward` (KV written without "
        f"the model: the same step cost, no prefill). Systems alive together per L: {groups}; "
        f"they take turns in rotating order through {cfg['repeats']} rounds of "
        f"{cfg['decode_steps']} decode and {cfg['chunk_steps']} chunk steps per N; a cell is "
        "the median over rounds of each round's median step (tokens/s in brackets: input "
        "tokens per second).", "",
        "### Decode step", "",
        step_table(result["decode"], result["labels"], "decode"), "",
        "### Chunk step", "",
        step_table(result["decode"], result["labels"], "chunk"), "", *figures, "",
    ]
    stream = [
        "## The streaming workload", "",
        f"{', '.join(map(str, cfg['stream_sessions']))} sessions, {cfg['stream_tokens_in']} "
        f"input + {cfg['stream_tokens_out']} output tokens per {cfg['stream_period_s']:g} s "
        f"frame, {cfg['stream_duration_s']:.0f} s, KV pool of {cfg['stream_pool_tokens']:,} "
        f"tokens; sessions' frames {_phases(cfg)}, the same arrival times for every arm. "
        f"Deadline: one frame period ({cfg['stream_period_s']:g} s). *Stock vLLM* and "
        f"*vLLM sliding window* ({resident} tokens) are vLLM's scheduler alone (a session's "
        "next chunk goes in when its last one is done, as `AsyncLLM`'s streaming input "
        "does); a frame is answered when its chunk is. *Metronome on vLLM* is the same "
        "engine under the beat, which answers a frame on time with its output or says why "
        "not (stalled_kv: no KV block).", "",
        "Every arm is counted by one rule from its own frame records. Frames due: those "
        "that arrived at least one deadline before the arm stopped. Never answered: frames "
        "due that got no answer at all (first unanswered: the earliest one's arrival). "
        "Goodput: frames due whose work was done with their output within the deadline, "
        "over frames due. Latency: of the frames due that were answered. First stall: the "
        "earliest frame the beat answered stalled_kv (only the beat answers that way).", "",
        stream_table(result["stream"]), "",
    ]
    return "\n".join(lines + (steps if result["decode"] else [])
                     + (stream if result["stream"] else []))


def _phases(cfg: dict) -> str:
    if cfg.get("stream_phases", "random") == "even":
        return "evenly spaced over the period"
    return "at seeded uniform-random phases of the period (they collide at times)"
