"""How much slower than the reference host this one is, for the suites' wall-clock budgets.

The budgets (a loop's time per message, a frame's deadline under attack) were set on an
AVX512-BF16 Zen 4 at ~3.7 GHz. On a slower host (a Zen 1-class EPYC at ~2 GHz, float32: no
bf16 there) the same work takes longer in proportion, so a budget kept as it is measures
the host instead of the code. `host_slowness` is that proportion, measured the same way on
every host: thread time to tokenize 4,000 printable characters (2.4 ms on the reference host,
5.5-6.0 ms on the Zen 1-class one), the fastest of 5. Work put somewhere by mistake costs more
on a slower host in the same proportion, so a scaled budget still catches it.

`UNHURRIED_DEADLINE_FRACTION` is for tests whose subject is not timeliness (token-exact
resume, an SDK's event handling): a late answer is cut short (`incomplete`), which would
make what they compare depend on the host's speed."""

from __future__ import annotations

import functools
import random
import time

from metronome.model.weights import load_tokenizer
from metronome.serve.config import MAX_DEADLINE_FRACTION

REFERENCE_TOKENIZE_S = 2.4e-3
UNHURRIED_DEADLINE_FRACTION = float(MAX_DEADLINE_FRACTION)


def printable(num_chars: int, rng: random.Random) -> str:
    return "".join(chr(rng.randrange(0x21, 0x7F)) for _ in range(num_chars))


@functools.cache
def host_slowness() -> float:
    """Thread time to tokenize 4,000 printable characters over the reference host's (at
    least 1: a faster host keeps the budgets); printed once."""
    tokenizer, text = load_tokenizer(), printable(4000, random.Random(25))
    costs_s = []
    for _ in range(5):
        started = time.thread_time()
        tokenizer.encode(text)
        costs_s.append(time.thread_time() - started)
    slowness = max(1.0, min(costs_s) / REFERENCE_TOKENIZE_S)
    print(f"host slowness: {slowness:.2f} (tokenizing 4,000 characters: "
          f"{min(costs_s) * 1e3:.2f} ms, reference {REFERENCE_TOKENIZE_S * 1e3:.1f} ms)")
    return slowness


def deadline_fraction(reference: float) -> float:
    """A deadline fraction set on the reference host, scaled to this one (at most
    ServerConfig's bound)."""
    return min(float(MAX_DEADLINE_FRACTION), reference * host_slowness())
