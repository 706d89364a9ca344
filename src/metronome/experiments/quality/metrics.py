"""Pure metrics over token ids and per-token NLL: perplexity, n-gram repetition and
diversity, and bucket means by stream position."""

from __future__ import annotations

import math
from collections import defaultdict

from metronome.experiments.quality.measure import PositionNll


def perplexity(values: list[float]) -> float | None:
    return math.exp(sum(values) / len(values)) if values else None


def ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def repeat_flags(generated: list[int], first_index: int, n: int = 4) -> list[bool]:
    """For each n-gram ending at index >= first_index: did it occur earlier in `generated`?"""
    seen, flags = set(), []
    for i, gram in enumerate(ngrams(generated, n)):
        if i + n - 1 >= first_index:
            flags.append(gram in seen)
        seen.add(gram)
    return flags


def distinct(tokens: list[int], n: int) -> float:
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams)


def rolling_repeat(generated: list[int], first_index: int, span: int) -> list[float]:
    flags = repeat_flags(generated, first_index)
    return [sum(flags[max(0, i - span + 1):i + 1]) / min(i + 1, span) for i in range(len(flags))]


def bucket_values(pairs: PositionNll, size: int) -> dict[int, list[float]]:
    """NLL values per bucket of `size` stream positions, by bucket index, in index order."""
    buckets: dict[int, list[float]] = defaultdict(list)
    for p, v in pairs:
        buckets[p // size].append(v)
    return dict(sorted(buckets.items()))


def bucket_means(pairs: PositionNll, size: int) -> dict[int, float]:
    """Mean NLL per bucket of `size` stream positions, by bucket index."""
    return {b: sum(v) / len(v) for b, v in bucket_values(pairs, size).items()}
