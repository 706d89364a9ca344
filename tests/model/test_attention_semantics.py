"""The engine's bounded attention equals naive references, whatever the chunking or batch, on
each attention path: the dense reference path, the paged kernel (every chunk of up to 16
tokens), and a mix of both in one step (chunks of up to 3 tokens paged, longer ones dense)."""

from __future__ import annotations

import pytest
import torch

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.stream import Stream
from tests.reference import reference_logits
from tests.steps import by_session

BLOCK = 4
# (attention, paged_max_chunk_tokens): the engine configurations every test here runs on
PATHS = {"dense": ("dense", 0), "paged": ("paged", 16), "mixed": ("paged", 3)}


@pytest.fixture(params=list(PATHS))
def attention_path(request, paged_kernel):
    if PATHS[request.param][0] == "paged":
        paged_kernel()  # skips (or fails) when the kernel is unavailable, saying why
    return PATHS[request.param]


def run_engine(model, sequences, policies, chunk_sizes, block_size=BLOCK, pool_tokens=4096,
               path=("dense", 0)):
    """Feed each sequence in chunks (all sessions batched per step); return per-token logits."""
    attention, paged_max = path
    engine = Engine(model, EngineConfig(block_size=block_size, pool_tokens=pool_tokens,
                                        max_chunk_tokens=64, max_step_tokens=4096,
                                        attention=attention, paged_max_chunk_tokens=paged_max))
    sids = [engine.open_session(Stream.of(SessionSpec(policy=p, return_logits=True)))
            for p in policies]
    logits = {sid: [] for sid in sids}
    cursors = dict.fromkeys(sids, 0)
    step_index = 0
    while any(cursors[s] < len(seq) for s, seq in zip(sids, sequences, strict=True)):
        for s, seq, sizes in zip(sids, sequences, chunk_sizes, strict=True):
            n = sizes[step_index % len(sizes)]
            if cursors[s] < len(seq):
                engine.submit(s, seq[cursors[s] : cursors[s] + n])
                cursors[s] += n
        while engine.has_work:
            for outcome in by_session(engine.step()).values():
                logits[outcome.session_id].append(outcome.logits)
        step_index += 1
    return [torch.cat(logits[s]) for s in sids], engine


def random_tokens(n, vocab, seed):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("rolling", [False, True])
def test_sinks_window_matches_naive_reference(tiny_model, rolling, attention_path):
    positions = "rolling" if rolling else "absolute"
    policies = [
        ResidencyPolicy.sinks_window(4, 10, positions),
        ResidencyPolicy.sinks_window(2, 7, positions),
        ResidencyPolicy.window(9, positions),
        ResidencyPolicy.sinks_window(6, 5, positions),  # sinks span two blocks
        # a session's retention_ratio: the window moves three blocks at a time
        ResidencyPolicy.sinks_window(3, 9, positions, slide_tokens=3 * BLOCK),
    ]
    lengths = [61, 47, 38, 55, 58]
    sequences = [random_tokens(n, tiny_model.config.vocab_size, i) for i, n in enumerate(lengths)]
    chunks = [[1], [3, 1, 5], [7, 2], [2, 9, 1], [4, 1]]
    got, engine = run_engine(tiny_model, sequences, policies, chunks, path=attention_path)
    for seq, policy, ours in zip(sequences, policies, got, strict=True):
        ref = reference_logits(tiny_model, seq, policy, BLOCK, rolling=rolling)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert all(engine.resident_tokens(s) <= p.max_resident_tokens(BLOCK)
               for s, p in zip(engine.sessions, policies, strict=True))


def test_rolling_differs_from_absolute_once_window_slides(tiny_model):
    """Guards the test above: the two position modes must not coincide by accident."""
    seq = random_tokens(40, tiny_model.config.vocab_size, 7)
    absolute = reference_logits(tiny_model, seq, ResidencyPolicy.sinks_window(4, 8), BLOCK)
    rolling = reference_logits(tiny_model, seq, ResidencyPolicy.sinks_window(4, 8), BLOCK, True)
    assert torch.allclose(absolute[:8], rolling[:8], atol=1e-5)  # window not yet slid
    assert not torch.allclose(absolute[-5:], rolling[-5:], atol=1e-3)


def test_unbounded_matches_dense_reference_in_a_mixed_batch(tiny_model, attention_path):
    vocab = tiny_model.config.vocab_size
    sequences = [random_tokens(n, vocab, 10 + n) for n in (33, 12, 50)]
    policies = [ResidencyPolicy.unbounded(), ResidencyPolicy.sinks_window(4, 8, "rolling"),
                ResidencyPolicy.unbounded()]
    got, _ = run_engine(tiny_model, sequences, policies, [[5], [1], [16, 3]],
                        path=attention_path)
    for seq, policy, ours in zip(sequences, policies, got, strict=True):
        rolling = policy.bounded
        ref = reference_logits(tiny_model, seq, policy, BLOCK, rolling=rolling)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("rolling", [False, True])
def test_long_chunks_on_the_paged_kernel_match_the_naive_reference(tiny_model, paged_kernel,
                                                                   rolling):
    """Chunks of up to 64 tokens (an engine with `paged_max_chunk_tokens=64`), longer than the
    window and crossing the sinks, read in place by the kernel."""
    paged_kernel()
    positions = "rolling" if rolling else "absolute"
    policies = [ResidencyPolicy.sinks_window(4, 10, positions), ResidencyPolicy.unbounded(),
                ResidencyPolicy.sinks_window(6, 24, positions)]
    lengths = [150, 131, 170]
    sequences = [random_tokens(n, tiny_model.config.vocab_size, 20 + i)
                 for i, n in enumerate(lengths)]
    chunks = [[64, 17], [23, 64, 1], [40, 33, 64]]
    got, _ = run_engine(tiny_model, sequences, policies, chunks, path=("paged", 64))
    for seq, policy, ours in zip(sequences, policies, got, strict=True):
        ref = reference_logits(tiny_model, seq, policy, BLOCK,
                               rolling=rolling and policy.bounded)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
