"""A session's KV bound, chosen with the Realtime API's `session.truncation` within the
server's ceilings, and its instructions pinned.

What each choice means here (the KV is the model's context; docs/serving.md says the same):

- `"auto"`: the server's bound (`--policy`, e.g. `sinks_window:4:512`): S attention sinks, then
  a window of W tokens.
- `{"type": "retention_ratio", "retention_ratio": r, "token_limits": {"post_instructions":
  n}}`: at most n tokens of conversation after the pinned instructions (n absent: the
  server's W); when they are full, the oldest (1 - r) x n leave at once (rounded down to whole
  KV blocks, at least one), so between about r x n and n stay, and blocks go back to the pool
  in batches. As the window's step D: a window of n - D + 1 moving D tokens at a time.
- `"disabled"`: no bound (every token stays, up to the model's trained positions, where the
  session ends `context_full`), where the server allows it (`--allow-unbounded-sessions`),
  and only before the session's first input (a window that has slid cannot grow back).

The session's instructions are pinned: when they are its first input they are the sinks
(their tokens, the model's first ones: the S attention sinks among them), so they never slide
out; up to `--max-pinned-tokens` (longer ones are refused). They are scored at rolling
positions (just before the window), which is what makes the model follow them 10 windows on.
Instructions changed later are re-pinned: the engine re-prefills them into fresh pinned
blocks once the window has left the old ones (`Engine.repin`); meanwhile they are in the
window as a system message.

The ceilings (`--max-window-tokens`, `--max-pinned-tokens`) hold for every session: a choice
above them is refused with the limit named, never clipped; `session.updated` shows the bound
in force (`truncation`, and the policy in the `metronome` block).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from metronome.kv.residency import PolicyKind, Positions, ResidencyPolicy
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.protocol.schema import RetentionRatio, TokenLimits

Choice = Literal["auto", "disabled"] | RetentionRatio
PARAM = "session.truncation"


@dataclass(frozen=True)
class BoundLimits:
    """The server's side: its default bound and the ceilings a session's choice must keep."""

    default: ResidencyPolicy
    block_size: int
    max_window_tokens: int
    max_pinned_tokens: int
    allow_unbounded: bool = False
    per_session: bool = True  # False: the engine serves one bound (vLLM's plugin)


@dataclass(frozen=True)
class SessionBound:
    """What a session chose (`truncation`) and how many of its first tokens are its pinned
    instructions; `policy` is the bound the engine serves it under."""

    truncation: Choice = "auto"
    pinned_tokens: int = 0  # its instructions, when they were its first input (0: none)
    rolled: bool = False  # it passed the model's trained positions: rolling from then on

    def policy(self, limits: BoundLimits) -> ResidencyPolicy:
        """Pinned instructions are scored at rolling positions: the window's keys keep their
        distances, the instructions sit just before the window, as at the start of a short
        conversation (at absolute positions, thousands of tokens back, the bundled model
        ignored them as it ignores them kept in a whole context: docs/results/
        instructions.md)."""
        base = limits.default
        if self.truncation == "disabled":
            return ResidencyPolicy.unbounded()
        sinks = max(base.sink_tokens, self.pinned_tokens)
        positions = Positions.ROLLING if self.pinned_tokens or self.rolled else base.positions
        if isinstance(self.truncation, RetentionRatio):
            n, step = _window_and_step(self.truncation, limits)
            return ResidencyPolicy(PolicyKind.SINKS_WINDOW, sinks, n - step + 1, positions,
                                   step if step != limits.block_size else None)
        if not base.bounded:
            return base
        return replace(base, kind=PolicyKind.SINKS_WINDOW if sinks else base.kind,
                       sink_tokens=sinks, positions=positions)

    def describe(self, limits: BoundLimits) -> Choice:
        """`truncation` as `session.updated` shows it: the effective values."""
        if not isinstance(self.truncation, RetentionRatio):
            return self.truncation
        n, _ = _window_and_step(self.truncation, limits)
        return RetentionRatio(type="retention_ratio",
                              retention_ratio=self.truncation.retention_ratio,
                              token_limits=TokenLimits(post_instructions=n))

    def saved(self) -> dict:
        truncation = self.truncation
        return {"truncation": truncation if isinstance(truncation, str)
                else truncation.model_dump(mode="json"), "pinned_tokens": self.pinned_tokens,
                "rolled": self.rolled}

    @classmethod
    def load(cls, saved: dict | None) -> SessionBound:
        if saved is None:  # a checkpoint from before bounds were per session
            return cls()
        truncation = saved["truncation"]
        choice: Choice = "auto" if truncation == "auto" else "disabled" if (
            truncation == "disabled") else RetentionRatio.model_validate(truncation)
        return cls(choice, saved["pinned_tokens"], saved.get("rolled", False))


def choose(truncation: Choice, current: SessionBound, limits: BoundLimits,
           started: bool) -> SessionBound:
    """`current` with `truncation` chosen, or `ClientError` saying which limit it passes
    (`started`: the session has had input, so its window may have slid)."""
    if not limits.per_session and truncation != "auto":
        raise ClientError(ErrorCode.UNSUPPORTED, "this server's engine (vLLM with the sinks+"
                          f"window plugin) serves one bound for every session "
                          f"({limits.default}): session.truncation is \"auto\" only", PARAM)
    if truncation == "disabled":
        if not limits.allow_unbounded:
            raise ClientError(ErrorCode.UNSUPPORTED, "unbounded sessions are not allowed on "
                              "this server (--allow-unbounded-sessions): choose \"auto\" or a "
                              "retention_ratio", PARAM)
        if started and current.truncation != "disabled":
            raise ClientError(ErrorCode.SESSION_LOCKED, "a bounded session cannot become "
                              "unbounded once its input has started (what left its window is "
                              "gone): choose \"disabled\" before the first input", PARAM)
    if isinstance(truncation, RetentionRatio):
        _window_and_step(truncation, limits)  # refused here if it passes a limit
    chosen = replace(current, truncation=truncation)
    _check_pinned(chosen.pinned_tokens, limits)
    return chosen


def pinned(current: SessionBound, num_tokens: int, limits: BoundLimits) -> SessionBound:
    """`current` with its first `num_tokens` (its instructions) pinned."""
    _check_pinned(num_tokens, limits)
    return replace(current, pinned_tokens=num_tokens)


def check_instructions(num_tokens: int, limits: BoundLimits) -> None:
    _check_pinned(num_tokens, limits, "session.instructions")


def _check_pinned(num_tokens: int, limits: BoundLimits, param: str = PARAM) -> None:
    if num_tokens > limits.max_pinned_tokens:
        raise ClientError(ErrorCode.INVALID_VALUE, f"the instructions are {num_tokens} tokens "
                          f"(as a system message); this server pins at most "
                          f"{limits.max_pinned_tokens} (--max-pinned-tokens), so they would "
                          "slide out of the context: shorten them", param)


def _window_and_step(choice: RetentionRatio, limits: BoundLimits) -> tuple[int, int]:
    """(n, D): the most tokens kept after the instructions and the window's step."""
    ratio = float(choice.retention_ratio)
    if not 0.0 <= ratio <= 1.0:
        raise ClientError(ErrorCode.INVALID_VALUE, f"retention_ratio must be in [0, 1], got "
                          f"{choice.retention_ratio}", f"{PARAM}.retention_ratio")
    limit = choice.token_limits.post_instructions if choice.token_limits else None
    block = limits.block_size
    n = limits.default.window_tokens if limit is None else limit
    param = f"{PARAM}.token_limits.post_instructions"
    if n is None:  # an unbounded server default and no limit given
        raise ClientError(ErrorCode.MISSING_PARAMETER, "this server's default keeps every "
                          "token: give token_limits.post_instructions", param)
    if not block <= n <= limits.max_window_tokens:
        raise ClientError(ErrorCode.INVALID_VALUE, f"post_instructions must be in [{block}, "
                          f"{limits.max_window_tokens}] (one KV block to this server's "
                          f"--max-window-tokens), got {n}", param)
    step = max(block, int((1.0 - ratio) * n) // block * block)
    return n, min(step, n // block * block)
