"""Block-table compaction keeps every visibility decision (metronome.vllm.compaction), checked
element by element: which physical cache slots each query sees, before and after."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from metronome.vllm.compaction import ceil_div, compact_block_table, max_compacted_len


def visible_slots(table_row, seq_len, q_len, sink_tokens, window_tokens, block_size):
    """{query index: set of (physical block, offset)} under j <= p and (j < S or p - j < W),
    in the row's own coordinates."""
    seen = {}
    for i in range(q_len):
        p = seq_len - q_len + i
        seen[i] = {(int(table_row[j // block_size]), j % block_size) for j in range(p + 1)
                   if j < sink_tokens or p - j < window_tokens}
    return seen


def batch(requests, block_size, width):
    table = torch.arange(1, 1 + len(requests) * width, dtype=torch.int32).view(-1, width)
    seq_lens = torch.tensor([n for n, _ in requests], dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(q for _, q in requests)], dtype=torch.int32)
    return table, seq_lens, starts


CASES = [(s, w, bs) for s in (0, 1, 4, 16, 40) for w in (1, 8, 37) for bs in (4, 16)]


@pytest.mark.parametrize("sink_tokens,window_tokens,block_size", CASES)
def test_every_query_sees_the_same_slots(sink_tokens, window_tokens, block_size):
    rng = random.Random(sink_tokens * 1000 + window_tokens * 10 + block_size)
    requests = [(rng.randint(1, 300), 1) for _ in range(6)]
    requests += [(n, rng.randint(1, n)) for n in (rng.randint(1, 300) for _ in range(6))]
    width = ceil_div(max(n for n, _ in requests), block_size) + 2
    table, seq_lens, starts = batch(requests, block_size, width)
    compacted, lengths = compact_block_table(table, seq_lens, starts, sink_tokens,
                                             window_tokens, block_size)
    bound = max_compacted_len(int(seq_lens.max()), max(q for _, q in requests), sink_tokens,
                              window_tokens, block_size)
    for r, (seq_len, q_len) in enumerate(requests):
        new_len = int(lengths[r])
        assert new_len <= bound and new_len >= q_len
        assert (seq_len - new_len) % block_size == 0  # moved by whole blocks
        assert visible_slots(compacted[r], new_len, q_len, sink_tokens, window_tokens,
                             block_size) == visible_slots(table[r], seq_len, q_len,
                                                          sink_tokens, window_tokens, block_size)


def test_a_long_decode_is_cut_to_sinks_plus_window():
    table, seq_lens, starts = batch([(32768, 1)], 16, 2048)
    compacted, lengths = compact_block_table(table, seq_lens, starts, 4, 512, 16)
    assert int(lengths[0]) <= 16 + 512 + 16  # one sink block + the window's blocks
    assert compacted[0, 0] == table[0, 0]  # the sink block stays first
    kept = ceil_div(int(lengths[0]), 16)
    assert compacted[0, 1:kept].tolist() == table[0, 2048 - kept + 1:].tolist()


def test_short_requests_are_left_alone_and_buffers_are_written_in_place():
    table, seq_lens, starts = batch([(100, 1), (520, 16)], 16, 40)
    out_table = torch.full((8, 40), -1, dtype=torch.int32)
    out_lens = torch.zeros(8, dtype=torch.int32)
    compacted, lengths = compact_block_table(table, seq_lens, starts, 4, 512, 16,
                                             out_table, out_lens)
    assert compacted.data_ptr() == out_table.data_ptr()
    assert lengths.data_ptr() == out_lens.data_ptr()
    assert torch.equal(compacted, table) and torch.equal(lengths, seq_lens)
    with pytest.raises(AssertionError, match="smaller"):
        compact_block_table(table, seq_lens, starts, 4, 512, 16,
                            torch.zeros(1, 40, dtype=torch.int32))
