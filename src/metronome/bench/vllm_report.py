"""The markdown report and plot of `metronome bench vllm` (from its JSON result)."""

from __future__ import annotations

from pathlib import Path

from metronome.bench.vllm_bench import NATIVE, PLUGIN, SLIDING, STOCK

LABELS = {STOCK: "stock vLLM", SLIDING: "vLLM sliding window", PLUGIN: "vLLM + Metronome",
          NATIVE: "native Metronome"}


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def decode_table(cells: list[dict]) -> list[str]:
    engines = [e for e in LABELS if any(c["engine"] == e for c in cells)]
    keys = sorted({(c["sessions"], c["context_tokens"]) for c in cells},
                  key=lambda k: (k[1], k[0]))
    by = {(c["engine"], c["sessions"], c["context_tokens"]): c for c in cells}
    head = "| N | L | " + " | ".join(f"{LABELS[e]} ms/step (tok/s)" for e in engines)
    lines = [head + " | plugin / sliding window |",
             "|" + "---|" * (len(engines) + 3)]
    for n, length in keys:
        row = [str(n), f"{length:,}"]
        for e in engines:
            c = by.get((e, n, length))
            row.append("-" if c is None else
                       f"{c['step_ms_median']:.1f} ({c['decode_tokens_per_s']:.0f})")
        plugin, sliding = by.get((PLUGIN, n, length)), by.get((SLIDING, n, length))
        ratio = (plugin["step_ms_median"] / sliding["step_ms_median"]
                 if plugin and sliding else None)
        lines.append("| " + " | ".join(row) + f" | {_fmt(ratio, '.2f')}x |")
    return lines


def stream_table(runs: list[dict]) -> list[str]:
    lines = ["| run | frames due | never answered | first stall / unanswered (s) | "
             "stalled_kv | goodput | p50 ms | p95 ms | health critical from (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        first = r.get("first_stall_arrival_s", r.get("first_unanswered_arrival_s"))
        lines.append(
            f"| {r['run']} | {r['frames']} | {r['never_answered']} | {_fmt(first)} | "
            f"{_fmt(r.get('stalled_kv_frames'), 'd')} | {_fmt(r['goodput'], '.3f')} | "
            f"{_fmt(r['latency_ms_p50'], '.0f')} | {_fmt(r['latency_ms_p95'], '.0f')} | "
            f"{_fmt(r.get('health_critical_first_s'))} |")
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["decode"]
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: dict, out_md: Path) -> None:
    cfg, machine = result["config"], result["machine"]
    png = out_md.with_suffix(".png")
    plot(result, png)
    bound = f"sinks_window:{cfg['sink_tokens']}:{cfg['window_tokens']}"
    lines = [
        "# Metronome on vLLM: the bound's step cost and the streaming deadlock",
        "",
        "Command: `.venv-vllm/bin/metronome bench vllm` (`make bench-vllm`; needs "
        "`make vllm-install`).",
        f"Machine: {machine['cpu_model']}, {machine['logical_cpus']} logical CPUs, "
        f"{machine['memory_gib']:.0f} GiB; torch {machine['torch']}, vLLM {machine['vllm']} "
        "(CPU build); SmolLM2-135M-Instruct at float32; one engine at a time, in one process; "
        f"total {result['elapsed_s'] / 60:.1f} min.",
        "",
        "## Decode step time",
        "",
        f"N sessions, each with L tokens of context, all decoding (median of "
        f"{cfg['decode_steps']} steps after the first). The bounded engines keep "
        f"{bound} ({cfg['sink_tokens'] + cfg['window_tokens']} tokens) resident per session; "
        f"the stock sliding window keeps {cfg['sink_tokens'] + cfg['window_tokens']} "
        "(the same resident KV; vLLM's `layer_types`: every layer sliding). Stock vLLM "
        "attends all L. The native engine reaches L with `fast_forward` (KV written without "
        "the model: the same step cost, no prefill).",
        "",
        *decode_table(result["decode"]),
        "",
        f"![decode step time]({png.name})",
        "",
        "## The streaming workload",
        "",
        f"{cfg['stream_sessions']} sessions, {cfg['stream_tokens_in']} input + "
        f"{cfg['stream_tokens_out']} output tokens per {cfg['stream_period_s']:g} s frame, "
        f"{cfg['stream_duration_s']:.0f} s, KV pool of {cfg['stream_pool_tokens']:,} tokens. "
        "Deadline: one frame period. *Stock vLLM* is vLLM's scheduler alone (a session's "
        "next chunk goes in when its last one is done, as `AsyncLLM`'s streaming input "
        "does); a frame counts as answered when its chunk is. *Metronome on vLLM* is the "
        "same engine under the beat: every frame gets a result by its deadline.",
        "",
        *stream_table(result["stream"]),
        "",
    ]
    lines += [f"- {note}" for note in cfg.get("notes", [])]
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text("\n".join(lines).rstrip() + "\n")
