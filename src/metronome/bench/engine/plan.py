"""What one engine-bench run measures (`Config`: the command's options), and how its
configurations are named.

A configuration is a `Key` (dtype, system, sessions, session_tokens); a system is a
residency policy of ours or `HF_SYSTEM`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from metronome.kv.residency import ResidencyPolicy

MIB = 1 << 20
GIB = 1 << 30
BLOCK_SIZE_TOKENS = 16
HF_SYSTEM = "transformers"

Key = tuple[str, str, int, int]  # (dtype, system, sessions, session_tokens)
KEY_FIELDS = ("dtype", "system", "sessions", "session_tokens")


@dataclass(frozen=True)
class Config:
    """What one run measures: the full grid, or the CI smoke size (same code path). The
    full size's budgets are for a 24 GiB machine that other work shares."""

    sessions: tuple[int, ...] = field(default=(1, 8, 32, 64),
                                      metadata={"help": "sessions decoding in one step (N)"})
    session_tokens: tuple[int, ...] = field(default=(1024, 4096, 8192), metadata={
        "help": "tokens of history per session (L)"})
    sink_tokens: int = field(default=4, metadata={"help": "the bounded policy's sinks"})
    window_tokens: int = field(default=512, metadata={"help": "the bounded policy's window"})
    repeats: int = field(default=5, metadata={"help": "timed steps per configuration"})
    warmup_steps: int = field(default=2, metadata={"help": "untimed steps before timing"})
    focus_sessions: int = field(default=32, metadata={
        "help": "N of the dtype comparison, overhead split and profile"})
    focus_tokens: tuple[int, ...] = field(default=(1024, 4096), metadata={
        "help": "L of the dtype comparison, overhead split and profile"})
    kv_budget_gib: float = field(default=6.0, metadata={
        "help": "cap on one configuration's KV (our pool or a transformers cache)"})
    side_by_side_budget_gib: float = field(default=8.0, metadata={
        "help": "cap on the KV of configurations measured together"})
    probe_busy_core: bool = field(default=True, metadata={
        "help": "wait-policy probe also with one core busy (slow under spinning)"})
    calibration_only: bool = field(default=False, metadata={
        "help": "measure only what the step cost model is fitted from: our policies over "
                "the (N, L) grid in the dtype `auto` resolves to (no transformers, no dtype "
                "comparison, no profile, no wait-policy probe)"})

    @classmethod
    def smoke(cls) -> Config:
        """CI size: seconds, same code path."""
        return cls(sessions=(1, 4), session_tokens=(64, 256), window_tokens=32, repeats=2,
                   warmup_steps=1, focus_sessions=4, focus_tokens=(64, 256), kv_budget_gib=1,
                   side_by_side_budget_gib=1, probe_busy_core=False)

    @property
    def kv_budget_bytes(self) -> int:
        return int(self.kv_budget_gib * GIB)

    @property
    def side_by_side_budget_bytes(self) -> int:
        return int(self.side_by_side_budget_gib * GIB)

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


def policy_name(policy: ResidencyPolicy) -> str:
    return str(policy).removesuffix("@absolute")


def label(key: Key) -> str:
    dtype, system, sessions, tokens = key
    return f"{dtype} {system} N={sessions} L={tokens}"


def progress(message: str) -> None:
    """One line of the bench's progress on stderr (stdout carries the results JSON)."""
    print(f"[bench engine] {message}", file=sys.stderr, flush=True)
