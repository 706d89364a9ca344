"""Which bound an engine runs with: one key in the model's config, read in every process.

The user sets it with vLLM's `hf_overrides`, so it travels inside the `VllmConfig` to the
engine-core and worker processes (no environment variable to forget in a child):

    LLM(model, hf_overrides={"metronome_residency": "sinks_window:4:512"})
    vllm serve MODEL --hf-overrides '{"metronome_residency": "sinks_window:4:512"}'

The value is parsed by `metronome.kv.residency.ResidencyPolicy.parse`: `sinks_window:S:W`
or `window:W` (S = 0), positions `@absolute` only. No key, or `unbounded`: stock vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from metronome.kv.residency import PolicyKind, Positions, ResidencyPolicy

HF_OVERRIDE_KEY = "metronome_residency"


@dataclass(frozen=True)
class SinksWindow:
    """Query at absolute position p sees key j iff j <= p and (j < S or p - j < W)."""

    sink_tokens: int  # S
    window_tokens: int  # W

    def __post_init__(self) -> None:
        if self.sink_tokens < 0 or self.window_tokens < 1:
            raise ValueError(f"need S >= 0 and W >= 1, got S={self.sink_tokens} "
                             f"W={self.window_tokens}")

    @property
    def full_attention_tokens(self) -> int:
        """Up to this many tokens every query sees every earlier key: S + W."""
        return self.sink_tokens + self.window_tokens


def parse_bound(text: str) -> SinksWindow | None:
    policy = ResidencyPolicy.parse(text)
    if policy.kind is PolicyKind.UNBOUNDED:
        return None
    if policy.positions is not Positions.ABSOLUTE:
        raise ValueError(
            f"{HF_OVERRIDE_KEY}={text!r}: vLLM stores keys rotated at their absolute "
            "position; @rolling would need them re-rotated in the kernel. Use @absolute."
        )
    assert policy.window_tokens is not None
    return SinksWindow(policy.sink_tokens, policy.window_tokens)


def bound_from_vllm_config(vllm_config) -> SinksWindow | None:
    """The engine's bound, or None for stock behaviour (plugin installed but not asked)."""
    model_config = getattr(vllm_config, "model_config", None)
    hf_config = getattr(model_config, "hf_config", None)
    text = getattr(hf_config, HF_OVERRIDE_KEY, None)
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{HF_OVERRIDE_KEY} must be a string like 'sinks_window:4:512', "
                         f"got {text!r}")
    return parse_bound(text)
