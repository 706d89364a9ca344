"""The quality experiment's two figures: (i) NLL by stream position per policy, and (ii)
free-running repetition and reference NLL. Each writes its PNG through the context."""

from __future__ import annotations

from metronome.experiments.quality.measure import FreeRunningText, TurnBasedNll
from metronome.experiments.quality.metrics import bucket_means, rolling_repeat
from metronome.experiments.quality.plan import HAMLET_TEXT, RECOMPUTE, Config
from metronome.experiments.quality.summary import FreeRunning
from metronome.results.context import RunContext

COLORS = {"dense": "tab:red", "window": "tab:orange", "sinks_window_absolute": "tab:green",
          "sinks_window_rolling": "tab:blue", RECOMPUTE: "black", HAMLET_TEXT: "grey"}
TURN_PLOT = "turn_based_nll.png"
FREE_PLOT = "free_running.png"
ROLLING_SPAN = 256  # 4-grams in the rolling repeated share


def plot_turn_based(ctx: RunContext, nll: TurnBasedNll, setup: Config,
                    max_positions: int) -> None:
    size = setup.plot_bucket_tokens
    means = {name: bucket_means(pairs, size) for name, pairs in nll.by_policy.items()}
    ref = means[RECOMPUTE]
    plt, save = ctx.figure(TURN_PLOT)
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, by_bucket in means.items():
        x = [(b + 0.5) * size for b in by_bucket]
        style = {"color": COLORS[name], "label": name, "linewidth": 1.2}
        axes[0].plot(x, list(by_bucket.values()), **style)
        axes[1].plot(x, [v - ref[b] for b, v in by_bucket.items()], **style)
    end = nll.last_position
    for ax in axes:
        ax.axvline(setup.turn_window_tokens, color="grey", linestyle="--", linewidth=1)
        if end >= max_positions:
            ax.axvline(max_positions, color="purple", linestyle=":", linewidth=1.2)
    axes[0].set_ylabel(f"NLL (nats), mean per {size} positions")
    axes[1].set_ylabel("NLL minus recompute_window")
    axes[1].axhline(0, color="black", linewidth=0.6)
    axes[1].set_xlabel("stream position (text + replies)")
    axes[0].legend(fontsize=8)
    limit = (f", purple: the model's {max_positions} positions" if end >= max_positions
             else f" (the model's {max_positions} positions lie beyond this run)")
    axes[0].set_title(f"(i) turn-based Hamlet: text-token NLL; dashed: window "
                      f"W={setup.turn_window_tokens}{limit}", fontsize=10)
    save(fig)


def plot_free_running(ctx: RunContext, free: FreeRunning, text: FreeRunningText) -> None:
    policies = free.policies
    plt, save = ctx.figure(FREE_PLOT)
    fig = plt.figure(figsize=(11, 7))
    grid = fig.add_gridspec(2, 2)
    bars = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    for ax, key, label in ((bars[0], "repeated_4gram_share", "repeated-4-gram share"),
                           (bars[1], "reference_nll", "NLL under recompute_window scorer")):
        shown = {n: v for n, p in policies.items() if (v := getattr(p, key)) is not None}
        ax.bar(range(len(shown)), list(shown.values()), color=[COLORS[n] for n in shown])
        ax.set_xticks(range(len(shown)), [n.replace("_", "\n") for n in shown], fontsize=7)
        ax.set_title(label, fontsize=10)
    rolling = fig.add_subplot(grid[1, :])
    first_index = text.first_index
    for name, tokens in (text.generated | {HAMLET_TEXT: text.human}).items():
        share = rolling_repeat(tokens, first_index, ROLLING_SPAN)
        # x: the stream position of each 4-gram's last token
        x = [text.prompt_tokens + first_index + i for i in range(len(share))]
        rolling.plot(x, share, color=COLORS[name], label=name, linewidth=1)
    rolling.set_xlabel("stream position of the generated token")
    rolling.set_ylabel(f"repeated-4-gram share\n(last {ROLLING_SPAN} 4-grams)")
    rolling.set_ylim(0, 1.02)
    rolling.legend(fontsize=8)
    fig.suptitle("(ii) free-running generation, measured after the window slid past the "
                 "session start", fontsize=10)
    save(fig)
