"""Named spans for torch.profiler around the compiled kernels (they are not aten ops, so a
profile would not see them otherwise), entered only while a profiler runs: entering a
`record_function` costs ~8 us, and a decode step calls the kernels ~150 times."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.profiler import record_function

T = TypeVar("T")


def in_span(event: str, fn: Callable[..., T], *args) -> T:
    """`fn(*args)`, inside a profiler span named `event` when a profiler is on."""
    if torch.autograd._profiler_enabled():
        with record_function(event):
            return fn(*args)
    return fn(*args)
