"""What one engine-bench run measures (`Plan`), and how its configurations are named.

A configuration is a `Key` (dtype, system, sessions, session_tokens); a system is a
residency policy of ours or `HF_SYSTEM`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from metronome.kv.residency import ResidencyPolicy

COMMAND = "metronome bench engine"
MIB = 1 << 20
GIB = 1 << 30
BLOCK_SIZE_TOKENS = 16
HF_SYSTEM = "transformers"

Key = tuple[str, str, int, int]  # (dtype, system, sessions, session_tokens)
KEY_FIELDS = ("dtype", "system", "sessions", "session_tokens")


@dataclass(frozen=True)
class Plan:
    """What one run measures: the full grid, or the CI smoke size (same code path)."""

    sessions: tuple[int, ...]
    session_tokens: tuple[int, ...]
    sink_tokens: int
    window_tokens: int
    repeats: int
    warmup_steps: int
    focus_sessions: int  # N of the dtype comparison, overhead split and profile
    focus_tokens: tuple[int, ...]  # L of those
    kv_budget_bytes: int  # cap on one configuration's KV (our pool or a transformers cache)
    side_by_side_budget_bytes: int  # cap on the KV of configurations measured together
    probe_busy_core: bool  # wait-policy probe also with one core busy (slow under spinning)

    @property
    def policies(self) -> dict[str, ResidencyPolicy]:
        bounded = ResidencyPolicy.sinks_window(self.sink_tokens, self.window_tokens)
        return {"unbounded": ResidencyPolicy.unbounded(), policy_name(bounded): bounded}

    @property
    def bounded_policy(self) -> str:
        return next(name for name in self.policies if name != "unbounded")

    @property
    def systems(self) -> list[str]:
        return [*self.policies, HF_SYSTEM]

    @property
    def decode_steps(self) -> int:
        """Steps a session must be able to take: warm-up, timed, phase split, profiled."""
        return self.warmup_steps + 3 * self.repeats


def make_plan(smoke: bool, repeats: int) -> Plan:
    if smoke:  # CI size: seconds, same code path
        return Plan(sessions=(1, 4), session_tokens=(64, 256), sink_tokens=4, window_tokens=32,
                    repeats=2, warmup_steps=1, focus_sessions=4, focus_tokens=(64, 256),
                    kv_budget_bytes=GIB, side_by_side_budget_bytes=GIB, probe_busy_core=False)
    # 24 GiB machine: no single KV above 6 GiB, no group above 8 GiB (other work shares it)
    return Plan(sessions=(1, 8, 32, 64), session_tokens=(1024, 4096, 8192), sink_tokens=4,
                window_tokens=512, repeats=repeats, warmup_steps=2, focus_sessions=32,
                focus_tokens=(1024, 4096), kv_budget_bytes=6 * GIB,
                side_by_side_budget_bytes=8 * GIB, probe_busy_core=True)


def policy_name(policy: ResidencyPolicy) -> str:
    return str(policy).removesuffix("@absolute")


def label(key: Key) -> str:
    dtype, system, sessions, tokens = key
    return f"{dtype} {system} N={sessions} L={tokens}"


def progress(message: str) -> None:
    """One line of the bench's progress on stderr (stdout carries the results JSON)."""
    print(f"[bench engine] {message}", file=sys.stderr, flush=True)
