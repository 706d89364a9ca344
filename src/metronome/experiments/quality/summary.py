"""What the quality experiment concludes, as typed records: per-policy perplexities of (i),
text metrics of (ii), and the paper's two claims judged with the stated margins.
`QualitySummary.to_json` is the experiment's summary.json (beside the common fields)."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import asdict, dataclass

from metronome.experiments.quality.measure import FreeRunningText, PositionNll, TurnBasedNll
from metronome.experiments.quality.metrics import (
    bucket_means,
    bucket_values,
    distinct,
    perplexity,
    repeat_flags,
)
from metronome.experiments.quality.plan import (
    FRAME_TOKENS,
    HAMLET_TEXT,
    POLICIES,
    RECOMPUTE,
    REPLY_TOKENS,
    Config,
    engine_policies,
    slide_position,
)

# Verdict thresholds for the report, stated there: a policy "matches" the reference when
# its perplexity is within 10%; free-running text is "degraded" when its reference NLL is
# 0.1 nats (~10% perplexity) higher or its repeated-4-gram share 0.05 higher.
PPL_TOLERANCE = 0.10
NLL_MARGIN_NATS = 0.1
REPEAT_MARGIN = 0.05
SINK_POLICIES = ("sinks_window_absolute", "sinks_window_rolling")
LOOP_SHARE = 0.5  # a reference policy repeating over half its 4-grams is stuck in a loop


class Verdict(enum.StrEnum):
    REPRODUCED = "reproduced"
    NOT_REPRODUCED = "not_reproduced"
    MIXED = "mixed"


class Gap(enum.StrEnum):
    """Window-only text against one sinks policy's."""

    WORSE = "worse"
    BETTER = "better"
    NO_DIFFERENCE = "no_difference"
    MIXED = "mixed"


# ---- (i) turn-based ------------------------------------------------------------------------
@dataclass(frozen=True)
class RegionPerplexity:
    """Perplexity over the stream positions of one region (None: no token there)."""

    all: float | None
    before_slide: float | None
    after_slide_within_model: float | None
    beyond_model_positions: float | None


@dataclass(frozen=True)
class BucketPerplexity:
    positions: tuple[int, int]  # [first, end) stream positions
    tokens: int
    ppl: float | None


@dataclass(frozen=True)
class TurnPolicy:
    scored_tokens: int
    mean_nll: float
    ppl: RegionPerplexity
    ppl_by_bucket: list[BucketPerplexity]


@dataclass(frozen=True)
class TurnBased:
    engine_policies: dict[str, str]
    window_tokens: int
    slide_position: int
    stream_positions: int
    model_positions: int
    policies: dict[str, TurnPolicy]
    plot_bucket_tokens: int
    nll_by_plot_bucket: dict[str, dict[int, float]]  # the plot's series: mean per bucket index

    def to_json(self) -> dict:
        size = self.plot_bucket_tokens
        return {
            "engine_policies": self.engine_policies, "window_tokens": self.window_tokens,
            "slide_position": self.slide_position, "stream_positions": self.stream_positions,
            "model_positions": self.model_positions,
            "policies": {name: asdict(p) for name, p in self.policies.items()},
            # mean NLL per `bucket_tokens` stream positions, keyed by the bucket's first one
            "nll_by_plot_bucket": {"bucket_tokens": size} | {
                name: {str(b * size): round(v, 4) for b, v in means.items()}
                for name, means in self.nll_by_plot_bucket.items()},
        }


def turn_policy(pairs: PositionNll, setup: Config,
                max_positions: int) -> TurnPolicy:
    slid = slide_position(setup.turn_window_tokens)
    regions = {
        "all": lambda p: True,
        "before_slide": lambda p: p < slid,
        "after_slide_within_model": lambda p: slid <= p < max_positions,
        "beyond_model_positions": lambda p: p >= max_positions,
    }
    size = setup.bucket_tokens
    return TurnPolicy(
        scored_tokens=len(pairs),
        mean_nll=sum(v for _, v in pairs) / len(pairs),
        ppl=RegionPerplexity(**{r: perplexity([v for p, v in pairs if keep(p)])
                                for r, keep in regions.items()}),
        ppl_by_bucket=[BucketPerplexity((b * size, (b + 1) * size), len(vals), perplexity(vals))
                       for b, vals in bucket_values(pairs, size).items()],
    )


def turn_summary(nll: TurnBasedNll, setup: Config, max_positions: int) -> TurnBased:
    w = setup.turn_window_tokens
    return TurnBased(
        engine_policies={n: str(p) for n, p in engine_policies(w).items()},
        window_tokens=w, slide_position=slide_position(w),
        stream_positions=setup.text_tokens // FRAME_TOKENS * (FRAME_TOKENS + REPLY_TOKENS),
        model_positions=max_positions,
        policies={name: turn_policy(pairs, setup, max_positions)
                  for name, pairs in nll.by_policy.items()},
        plot_bucket_tokens=setup.plot_bucket_tokens,
        nll_by_plot_bucket={name: bucket_means(pairs, setup.plot_bucket_tokens)
                            for name, pairs in nll.by_policy.items()},
    )


# ---- (ii) free-running ---------------------------------------------------------------------
@dataclass(frozen=True)
class FreePolicy:
    """One policy's measured text (or the play's own, with no reference NLL or sample)."""

    measured_tokens: int
    repeated_4gram_share: float
    distinct_1: float
    distinct_2: float
    distinct_4: float
    reference_nll: float | None
    reference_ppl: float | None
    sample_end: str | None  # the last ~200 characters generated


@dataclass(frozen=True)
class FreeRunning:
    engine_policies: dict[str, str]
    window_tokens: int
    first_measured_position: int
    policies: dict[str, FreePolicy]  # the five policies, then HAMLET_TEXT


def free_policy(tokens: list[int], first_index: int, reference_nll: list[float] | None,
                sample_end: str | None) -> FreePolicy:
    measured = tokens[first_index:]
    flags = repeat_flags(tokens, first_index)
    scored = reference_nll is not None
    return FreePolicy(
        measured_tokens=len(measured), repeated_4gram_share=sum(flags) / len(flags),
        distinct_1=distinct(measured, 1), distinct_2=distinct(measured, 2),
        distinct_4=distinct(measured, 4),
        reference_nll=sum(reference_nll) / len(reference_nll) if scored else None,
        reference_ppl=perplexity(reference_nll) if scored else None, sample_end=sample_end)


def free_summary(text: FreeRunningText, setup: Config, tokenizer) -> FreeRunning:
    first_index = text.first_index
    policies = {name: free_policy(tokens, first_index, [v for _, v in text.reference_nll[name]],
                                  tokenizer.decode(tokens[-120:])[-200:])
                for name, tokens in text.generated.items()}
    # the play itself over the same span: what the n-gram metrics read on human text
    policies[HAMLET_TEXT] = free_policy(text.human, first_index, None, None)
    w = setup.free_window_tokens
    return FreeRunning(engine_policies={n: str(p) for n, p in engine_policies(w).items()},
                       window_tokens=w, first_measured_position=text.first_position,
                       policies=policies)


# ---- the claims ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TurnClaim:
    """The window alone suffices for turn-based decoding (perplexity after the slide)."""

    window_ppl_after_slide: float
    recompute_ppl_after_slide: float
    ratio: float
    verdict: Verdict


@dataclass(frozen=True)
class FreeGap:
    window_minus_sinks_reference_nll: float
    window_minus_sinks_repeated_4gram_share: float
    window_vs_sinks: Gap


@dataclass(frozen=True)
class FreeClaim:
    """Sinks are essential for free-running generation."""

    against: dict[str, FreeGap]  # by sinks policy
    verdict: Verdict
    references_loop: bool  # a looping reference makes low NLL mean "predictable", not "good"


@dataclass(frozen=True)
class Claims:
    window_suffices_turn_based: TurnClaim
    sinks_essential_free_running: FreeClaim


def claims(turn: TurnBased, free: FreeRunning) -> Claims:
    """The paper's two claims, judged from the measured values with the stated margins."""
    window = turn.policies["window"].ppl.after_slide_within_model
    ref = turn.policies[RECOMPUTE].ppl.after_slide_within_model
    gaps = {name: free_gap(free.policies, name) for name in SINK_POLICIES}
    verdicts = {g.window_vs_sinks for g in gaps.values()}
    if verdicts == {Gap.WORSE}:
        free_verdict = Verdict.REPRODUCED
    elif verdicts & {Gap.BETTER, Gap.NO_DIFFERENCE}:
        free_verdict = Verdict.NOT_REPRODUCED
    else:
        free_verdict = Verdict.MIXED
    turn_verdict = Verdict.REPRODUCED if window / ref <= 1 + PPL_TOLERANCE else (
        Verdict.NOT_REPRODUCED)
    loops = min(free.policies[n].repeated_4gram_share for n in ("dense", RECOMPUTE))
    return Claims(TurnClaim(window, ref, window / ref, turn_verdict),
                  FreeClaim(gaps, free_verdict, references_loop=loops >= LOOP_SHARE))


def free_gap(policies: dict[str, FreePolicy], sinks: str) -> FreeGap:
    """Window-only against one sinks policy. Free-running text fails two ways: it drifts
    into text the reference finds unlikely (higher NLL) or it loops (higher repeated-4-gram
    share, and *lower* NLL, since a loop is predictable); the two can disagree."""
    window, other = policies["window"], policies[sinks]
    nll_gap = window.reference_nll - other.reference_nll
    repeat_gap = window.repeated_4gram_share - other.repeated_4gram_share
    worse = nll_gap >= NLL_MARGIN_NATS or repeat_gap >= REPEAT_MARGIN
    better = nll_gap <= -NLL_MARGIN_NATS or repeat_gap <= -REPEAT_MARGIN
    verdict = (Gap.MIXED if worse and better else Gap.WORSE if worse else
               Gap.BETTER if better else Gap.NO_DIFFERENCE)
    return FreeGap(nll_gap, repeat_gap, verdict)


# ---- the whole -----------------------------------------------------------------------------
@dataclass(frozen=True)
class QualitySummary:
    model: str
    dtype: str
    setup: Config
    turn_based: TurnBased
    free_running: FreeRunning
    claims: Claims
    phase_elapsed_s: dict[str, float]

    def to_json(self) -> dict:
        return {"model": self.model, "dtype": self.dtype, "setup": asdict(self.setup),
                "policies": list(POLICIES), "turn_based": self.turn_based.to_json(),
                "free_running": asdict(self.free_running), "claims": asdict(self.claims),
                "phase_elapsed_s": self.phase_elapsed_s}

    @classmethod
    def from_json(cls, data: dict) -> QualitySummary:
        """The summary back from its JSON (what the report reads)."""
        turn = dict(data["turn_based"])
        plot = dict(turn.pop("nll_by_plot_bucket"))
        size = plot.pop("bucket_tokens")
        turn |= {"plot_bucket_tokens": size, "nll_by_plot_bucket": {
            name: {int(start) // size: v for start, v in means.items()}
            for name, means in plot.items()}}
        return _typed(cls, {k: v for k, v in data.items() if k != "policies"}
                      | {"turn_based": turn})


def build_summary(setup: Config, model_name: str, nll: TurnBasedNll,
                  text: FreeRunningText, tokenizer, max_positions: int,
                  phase_elapsed_s: dict[str, float]) -> QualitySummary:
    turn = turn_summary(nll, setup, max_positions)
    free = free_summary(text, setup, tokenizer)
    return QualitySummary(model_name, "float32", setup, turn, free, claims(turn, free),
                          phase_elapsed_s)


def _typed(hint, value):
    """`value` (parsed JSON) as the type `hint`: dataclasses, dicts, lists, tuples, enums."""
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: _typed(hints[f.name], value[f.name])
                       for f in dataclasses.fields(hint) if f.name in value})
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (types.UnionType, typing.Union):
        return _typed(next(a for a in args if a is not type(None)), value)
    if origin is dict:
        return {_typed(args[0], k): _typed(args[1], v) for k, v in value.items()}
    if origin is list:
        return [_typed(args[0], v) for v in value]
    if origin is tuple:
        return tuple(value)
    if hint is int and isinstance(value, str):
        return int(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    return value
