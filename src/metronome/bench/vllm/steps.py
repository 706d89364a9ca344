"""The steps the vLLM benches time, the same for every system: a prefill to L tokens, pure
decode steps (each session feeds one token, samples one) and chunk steps (each session
feeds a chunk of real text, samples one: the streaming workload's input step)."""

from __future__ import annotations

import time

import torch


def set_threads(wanted: int) -> int:
    """Set torch's threads if they differ (vLLM's CPU worker replaces set_num_threads with a
    warning after it binds its threads); returns the count in effect."""
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    return torch.get_num_threads()


def prefill(engine, sids: list[int], length: int, ids: list[int]) -> float:
    """Each session prefills `length` tokens of `ids` (its own offset); seconds taken."""
    started = time.perf_counter()
    for k, sid in enumerate(sids):
        offset = (k * 997) % length
        engine.submit_prepared(sid, engine.prepare_input(ids[offset:offset + length], None), 0)
    while engine.has_work:
        engine.step()
    return time.perf_counter() - started


def decode_steps(engine, sids: list[int], steps: int, threads: int) -> list[float]:
    """Pure decode steps of these sessions (each feeds one token, samples one): step ms."""
    set_threads(threads)
    for sid in sids:
        engine.submit_prepared(sid, engine.prepare_input([13], None), steps + 1)
    times = []
    while engine.has_work:
        t0 = time.perf_counter()
        result = engine.step()
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        if result.num_input_tokens == len(sids):
            times.append(elapsed_ms)
    return times[1:] or times  # the first step of a batch warms it up


def chunk_steps(engine, sids: list[int], chunks: int, chunk_ids: list[int], threads: int
                ) -> list[float]:
    """`chunks` steps in which every session feeds `chunk_ids` and samples one token (one
    step each: the chunk is within every system's per-step budget): step ms. A session's
    last sampled token, if not yet fed back, goes in with its chunk (one more token)."""
    set_threads(threads)
    times = []
    for _ in range(chunks):
        for sid in sids:
            engine.submit_prepared(sid, engine.prepare_input(chunk_ids, None), 1)
        while engine.has_work:
            t0 = time.perf_counter()
            result = engine.step()
            elapsed_ms = (time.perf_counter() - t0) * 1e3
            if result.num_input_tokens >= len(sids) * len(chunk_ids):
                times.append(elapsed_ms)
    return times
