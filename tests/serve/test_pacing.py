"""A reply's listener (`serve.realtime.pacing.Playback`): pieces played at real time from
the first; one that arrives after the buffer ran out is a gap of the time it ran dry."""

from __future__ import annotations

import pytest

from metronome.serve.realtime.pacing import Playback


def test_a_listener_kept_ahead_hears_no_gap():
    playback = Playback()
    assert playback.add(10.0, 2.0) == 0.0  # the first piece starts playback
    assert playback.add(11.5, 2.0) == 0.0  # 0.5 s still buffered
    assert playback.add(12.0, 1.0) == 0.0
    assert (playback.gap_count, playback.played_s, playback.ends_at_s) == (0, 5.0, 15.0)
    assert playback.buffered_s(14.0) == pytest.approx(1.0) and playback.buffered_s(16.0) == 0.0


def test_a_piece_after_the_buffer_ran_dry_is_a_gap_as_long_as_the_silence():
    playback = Playback()
    playback.add(0.0, 1.0)
    assert playback.add(1.25, 1.0) == pytest.approx(0.25)  # silent from 1.0 to 1.25
    assert playback.ends_at_s == pytest.approx(2.25)  # playback resumes at the piece
    assert playback.add(2.25, 0.5) == 0.0  # exactly in time: no gap
    assert playback.add(3.75, 0.5) == pytest.approx(1.0)
    assert playback.gap_count == 2 and playback.total_gap_ms == pytest.approx(1250.0)
    assert playback.gap_ms == pytest.approx([250.0, 1000.0])


def test_pieces_out_of_order_in_time_are_refused():
    playback = Playback()
    playback.add(5.0, 1.0)
    with pytest.raises(AssertionError):
        playback.add(4.0, 1.0)
    with pytest.raises(AssertionError):
        playback.add(6.0, -1.0)
