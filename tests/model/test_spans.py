"""The compiled kernels' profiler spans: present under torch.profiler (the bench's step
split counts the kernels by them), and the call goes through the same without one."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from metronome.model.spans import in_span


def test_a_span_is_recorded_only_under_the_profiler():
    calls = []

    def work(a, b):
        calls.append((a, b))
        return a + b

    assert in_span("metronome::probe", work, 2, 3) == 5
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert in_span("metronome::probe", work, 4, 5) == 9
    assert calls == [(2, 3), (4, 5)]
    assert "metronome::probe" in {e.name for e in prof.events()}
    assert not torch.autograd._profiler_enabled()
