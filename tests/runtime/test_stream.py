"""The stream's input has one home: whatever is appended, read from any offset, trimmed and
withdrawn, `read` gives back exactly the positions appended (one kind at a time), and the
counts the server and the beat use are derived from the offsets alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.runtime.profile import SessionProfile
from metronome.stream import Frame, Stream

HIDDEN = 4

# (kind, size): token ids or embeddings, 1 to 9 positions
CHUNKS = st.lists(st.tuples(st.sampled_from(["ids", "emb"]), st.integers(1, 9)), min_size=1,
                  max_size=12)


def make(kind: str, size: int, first: int) -> torch.Tensor:
    """Positions numbered from `first`, as ids or as embeddings carrying the number."""
    values = torch.arange(first, first + size)
    return values if kind == "ids" else values[:, None].float().repeat(1, HIDDEN)


def positions(data: torch.Tensor) -> list[int]:
    return (data if data.dim() == 1 else data[:, 0].long()).tolist()


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(chunks=CHUNKS, reads=st.lists(st.tuples(st.integers(0, 120), st.integers(1, 20)),
                                     max_size=10))
def test_read_gives_back_what_was_appended_one_kind_at_a_time(chunks, reads):
    stream, kinds = Stream("s"), []
    for kind, size in chunks:
        start, end = stream.append(make(kind, size, stream.received_tokens))
        assert (start, end) == (len(kinds), len(kinds) + size)
        kinds += [kind] * size
    for start, max_tokens in reads:
        start %= stream.received_tokens
        data = stream.read(start, max_tokens)
        got = positions(data)
        assert got == list(range(start, start + len(got))) and 1 <= len(got) <= max_tokens
        assert {kinds[p] for p in got} == {kinds[start]}  # one kind
        end = start + len(got)
        # it stops short only at the end, the limit, or where the kind changes
        assert end == stream.received_tokens or len(got) == max_tokens or kinds[end] != kinds[
            start]
        assert stream.kind_run_end(start) >= end


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(chunks=CHUNKS, steps=st.lists(st.integers(1, 15), max_size=12))
def test_trimmed_input_is_gone_and_the_rest_reads_the_same(chunks, steps):
    stream = Stream("s")
    for kind, size in chunks:
        stream.append(make(kind, size, stream.received_tokens))
    read = 0
    for step in steps:
        read = min(stream.received_tokens, read + step)
        stream.trim(read)  # the engine thread drops what it has read
        if read < stream.received_tokens:
            assert positions(stream.read(read, 1)) == [read]
        assert stream._head <= read  # only whole chunks behind the reader go


def test_counts_are_derived_from_the_offsets():
    stream = Stream("s", SessionProfile(max_queued_input_tokens=20))
    answered = Frame("s", 0.0)
    answered.start_offset, answered.end_offset = stream.append(torch.arange(6))
    stream.last_answered = answered
    flight = Frame("s", 1.0)
    flight.start_offset, flight.end_offset = stream.append(torch.arange(4))
    stream.in_flight = flight
    preparing = Frame("s", 1.5, input_tokens=3)
    stream.frames.extend([flight, preparing])
    stream.fed_tokens = 8
    stream.consumed(5)
    assert stream.backlog_tokens == 1  # answered frame's input, not yet consumed
    assert stream.submitted_queued_tokens == 5 and stream.queued_input_tokens == 8
    assert stream.feedable_until == 10 and stream.fits(12) and not stream.fits(13)
    with pytest.raises(AssertionError):
        stream.consumed(4)  # past what was fed: a bug


def test_a_withdrawn_waiting_frame_leaves_with_its_input():
    stream = Stream("s")
    frames = [Frame("s", 0.0) for _ in range(3)]
    for k, frame in enumerate(frames):
        frame.start_offset, frame.end_offset = stream.append(torch.full((3,), k))
        stream.frames.append(frame)
    stream.fed_tokens = 3  # the first went to the engine
    stream.drop(frames[1])
    stream.frames.remove(frames[1])
    assert stream.received_tokens == 6
    assert (frames[2].start_offset, frames[2].end_offset) == (3, 6)  # moved up
    assert stream.read(0, 10).tolist() == [0, 0, 0, 2, 2, 2]
    with pytest.raises(AssertionError):
        stream.drop(frames[0])  # fed already: it cannot leave
