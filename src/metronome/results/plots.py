"""Plots more than one report draws (matplotlib, imported when a plot is made)."""

from __future__ import annotations

from pathlib import Path


def plot_cap_history(name: str, summary: dict, n_star: int | None, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = summary["history"]
    t = [h["at_s"] for h in history]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ax1.plot(t, [h["cap"] for h in history], label="admission cap")
    ax1.plot(t, [h["active_sessions"] for h in history], label="active sessions")
    if n_star:
        ax1.axhline(n_star, color="grey", linestyle="--", label=f"swept N* = {n_star}")
    if summary.get("saturated_at_s"):
        for ax in (ax1, ax2):
            ax.axvline(summary["saturated_at_s"], color="red", linestyle=":",
                       label="pool saturated")
    ax1.set_ylabel("sessions")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.plot(t, [h["latency_fraction"] for h in history], color="tab:purple",
             label="p95 latency / deadline")
    ax2.plot(t, [h["stalled"] / max(1, h["frames"]) for h in history], color="tab:red",
             label="stalled_kv share of frames")
    ax2.axhline(0.8, color="grey", linestyle="--", label="target 0.8")
    ax2.set_xlabel("time (s)")
    ax2.legend(loc="upper left", fontsize=8)
    ax1.set_title(name)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
