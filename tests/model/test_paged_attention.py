"""The fast path against the reference path: the compiled paged-attention kernel (KV read in
place) vs the dense gather + SDPA path, and prepacked oneDNN projections vs `F.linear`.

The naive-reference tests of the bound's semantics run on every path too
(`test_attention_semantics.py`); here the two engine paths are compared directly on long,
churned histories (blocks scattered through the pool, windows sliding, sessions closing and
reopening), on the bundled model, in bfloat16, and the kernel's and the engine's refusals.
"""

from __future__ import annotations

import random

import pytest
import torch

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model import native
from metronome.model.config import TINY_LLAMA
from metronome.model.weights import random_model
from metronome.stream import Stream
from tests.steps import by_session

POLICIES = ["unbounded", "window:24", "sinks_window:4:24", "sinks_window:4:24@rolling",
            "sinks_window:9:8@rolling", "window:13@rolling"]


def churned_run(model, attention, paged_max, seed, block_size=4, rounds=14):
    """Sessions under every policy, fed random chunks and decoding, some closed and new ones
    opened mid-way so the pool's free list is shuffled. Returns (logits, tokens) per step."""
    engine = Engine(model, EngineConfig(block_size=block_size, pool_tokens=8192,
                                        max_chunk_tokens=8, attention=attention,
                                        paged_max_chunk_tokens=paged_max))
    rng = random.Random(seed)
    vocab = model.config.vocab_size

    opened = iter(range(1_000))

    def open_one(policy):  # the same ids in every engine: their logs are compared
        return engine.open_session(Stream(f"s{next(opened)}", spec=SessionSpec(
            policy=ResidencyPolicy.parse(policy), stop_token_ids=(), return_logits=True)))

    sids = [open_one(p) for p in POLICIES]
    log = []
    for r in range(rounds):
        if r in (5, 9):  # close two sessions, open two: their blocks come back shuffled
            for sid in rng.sample(sids, 2):
                engine.close(sid)
                sids.remove(sid)
                sids.append(open_one(rng.choice(POLICIES)))
        for sid in sids:
            n = rng.choice([1, 1, 2, 5, 8, 13])
            engine.submit(sid, [rng.randrange(vocab) for _ in range(n)],
                          max_new_tokens=rng.choice([0, 1, 3]))
        while engine.has_work:
            for step in by_session(engine.step()).values():
                log.append((step.session_id, step.logits, tuple(step.new_token_ids)))
    return log


@pytest.mark.parametrize("paged_max", [16, 2])  # every chunk paged; a mix of both paths
def test_paged_kernel_matches_dense_path_on_churned_histories(paged_kernel, paged_max):
    paged_kernel()
    model = random_model(TINY_LLAMA, torch.float32, seed=3)
    dense = churned_run(model, "dense", 0, seed=11)
    paged = churned_run(model, "paged", paged_max, seed=11)
    assert [(s, t) for s, _, t in dense] == [(s, t) for s, _, t in paged]
    for (_, want, _), (_, got, _) in zip(dense, paged, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_paged_kernel_matches_dense_path_in_bfloat16(paged_kernel):
    paged_kernel()
    model = random_model(TINY_LLAMA, torch.bfloat16, seed=3)
    dense = churned_run(model, "dense", 0, seed=5, rounds=8)
    paged = churned_run(model, "paged", 16, seed=5, rounds=8)
    for (sid_d, want, _), (sid_p, got, _) in zip(dense, paged, strict=True):
        assert sid_d == sid_p
        # bf16 rounds every product; the kernel accumulates in float32, SDPA in bf16 blocks
        torch.testing.assert_close(got, want, atol=6e-2, rtol=5e-2)


def _kernel_inputs(head_dim: int, block_size: int, dtype: torch.dtype, group: int = 3):
    """Two sessions over a shuffled pool: one unbounded (8 blocks), one with 4 sinks and a
    window (logical blocks 0, 6, 7, 8; its sink block scored with q_sink, as rolling
    positions do); queries at a block's end, mid-block, position 0 and past the resident
    blocks. The kernel's arguments, in order."""
    g = torch.Generator().manual_seed(head_dim * 100 + block_size)
    kvh, pool_blocks = 2, 24
    k, v = (torch.randn(kvh, pool_blocks * block_size, head_dim, generator=g)
            for _ in range(2))
    perm = torch.randperm(pool_blocks, generator=g)
    block_ids = torch.zeros(2, 8, dtype=torch.long)
    block_logical = torch.zeros(2, 8, dtype=torch.long)
    block_ids[0], block_logical[0] = perm[:8], torch.arange(8)
    block_ids[1, :4], block_logical[1, :4] = perm[8:12], torch.tensor([0, 6, 7, 8])
    bs = block_size
    # (session, position, window_start)
    tokens = [(0, 8 * bs - 1, 0), (0, 5 * bs + 3, 0), (0, 0, 0),
              (1, 9 * bs - 1, 6 * bs + 1), (1, 7 * bs + 2, 6 * bs - 3)]
    t = len(tokens)
    q, q_sink = (torch.randn(t, kvh * group, head_dim, generator=g) * 2 for _ in range(2))
    longs = [torch.tensor(col, dtype=torch.long) for col in zip(*tokens, strict=True)]
    return (q.to(dtype), q_sink.to(dtype), k.to(dtype), v.to(dtype), *longs, block_ids,
            block_logical, torch.tensor([8, 4]), torch.tensor([0, 4]), torch.tensor([0, 1]),
            block_size, head_dim**-0.5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 16, 48])  # a chunk's tail, one chunk, three
@pytest.mark.parametrize("group", [1, 3, 4, 6])  # query heads per kv head (6: 4 + 2)
def test_bf16_kernel_matches_its_float32_task(paged_kernel, head_dim, block_size, group):
    """bf16 at head sizes 64 and 128 runs the AVX512-BF16 task where the CPU has it (16
    keys at a time, `vdpbf16ps` dot products; the values of up to 4 query heads a pass),
    float32 its own task (held to the float64 generic task below): on the same
    (bf16-valued) inputs they agree to bf16's rounding of the output."""
    kernel = paged_kernel()
    args = _kernel_inputs(head_dim, block_size, torch.bfloat16, group)
    got = kernel.paged_attention(*args).float()
    exact = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
             for a in args]
    want = kernel.paged_attention(*exact)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [4, 8, 20, 48])  # a chunk's tail, one chunk, 2.5, six
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7])  # query heads per kv head (7: 3 + 3 + 1)
def test_float32_kernel_matches_its_float64_task(paged_kernel, head_dim, block_size, group):
    """float32 at head sizes 64 and 128 runs the AVX2 task where the CPU has it (8 keys at a
    time, the values of up to 3 query heads a pass), float64 the generic task: on the same
    (float32-valued) inputs they agree to float32's rounding."""
    kernel = paged_kernel()
    args = _kernel_inputs(head_dim, block_size, torch.float32, group)
    got = kernel.paged_attention(*args)
    exact = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
             for a in args]
    want = kernel.paged_attention(*exact)
    torch.testing.assert_close(got, want.float(), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vector_tasks_switch_runs_the_generic_task(paged_kernel, dtype):
    """`set_vector_tasks(False)` (for benches comparing the two in one process) runs the
    generic task: the results agree to the dtype's rounding, the switch goes back, and in
    float32, where the CPU has its vector task, the bits change (another summation order).
    bf16 outputs are not compared bit for bit: both tasks accumulate in float32 and round to
    bf16, which on an AVX512-BF16 host absorbed every difference of this input (CI)."""
    kernel = paged_kernel()
    args = _kernel_inputs(64, 20, dtype, 3)
    assert kernel.vector_tasks(), "the vector tasks are the default"
    vector = kernel.paged_attention(*args)
    kernel.set_vector_tasks(False)
    try:
        assert not kernel.vector_tasks()
        generic = kernel.paged_attention(*args)
    finally:
        kernel.set_vector_tasks(True)
    assert kernel.vector_tasks()
    if dtype == torch.float32:
        has_task = "float32" in kernel.vector_task_dtypes()
        assert torch.equal(vector, generic) is not has_task
    tol = {"atol": 2e-6, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(vector.float(), generic.float(), **tol)


def test_the_far_prefetch_switch_never_changes_a_bit(paged_kernel):
    """The bf16 task's prefetch of the block after next (on or off by CPU vendor) only asks
    for memory: both settings give the same bits, at every block size, and the setting
    `native.kernel()` chose for this CPU is restored."""
    kernel = paged_kernel()
    chosen = kernel.bf16_far_prefetch()
    assert chosen == native.far_prefetch_pays(native.proc_lines("/proc/cpuinfo"))
    try:
        for block_size in (4, 16, 48):
            args = _kernel_inputs(64, block_size, torch.bfloat16, 3)
            kernel.set_bf16_far_prefetch(True)
            far = kernel.paged_attention(*args)
            kernel.set_bf16_far_prefetch(False)
            assert not kernel.bf16_far_prefetch()
            assert torch.equal(kernel.paged_attention(*args), far)
    finally:
        kernel.set_bf16_far_prefetch(chosen)
    assert kernel.bf16_far_prefetch() == chosen


@pytest.mark.parametrize(("vendor", "far"), [("AuthenticAMD", True), ("GenuineIntel", False),
                                             (None, False)])
def test_far_prefetch_is_for_amd_cpus(vendor, far):
    cpuinfo = ["processor\t: 0"] + ([f"vendor_id\t: {vendor}"] if vendor else [])
    assert native.far_prefetch_pays(cpuinfo) is far


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_write_attend_is_rope_then_write_then_attention(paged_kernel, dtype):
    """The decode path's one call per layer gives the bits of the calls it replaces: the fused
    RoPE on q and k, k and v written to their slots, the kernel over the rotated q."""
    from metronome.model import rope

    kernel, fused = paged_kernel(), native.fused_ops()
    if fused is None:
        pytest.skip(native.FUSED.reason())
    q, _, k_cache, v_cache, session, position, window, *tables = _kernel_inputs(64, 16, dtype)
    t, heads, hd = q.shape
    kvh = k_cache.shape[0]
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(t, (heads + 2 * kvh) * hd, generator=g).to(dtype)
    cos, sin = rope.cos_sin(position, rope.inv_frequencies(hd, 10_000.0), dtype)
    slots = torch.randperm(k_cache.shape[1], generator=g)[:t]
    got_k, got_v = k_cache.clone(), v_cache.clone()
    got = kernel.rope_write_attend(qkv, cos, sin, got_k, got_v, slots, heads, session,
                                   position, window, *tables)
    q_part, k_part, v_part = qkv.split((heads * hd, kvh * hd, kvh * hd), dim=-1)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.index_copy_(1, slots, fused.rope(k_part.view(t, kvh, hd), cos, sin).transpose(0, 1))
    want_v.index_copy_(1, slots, v_part.reshape(t, kvh, hd).transpose(0, 1))
    want = kernel.paged_attention(fused.rope(q_part.view(t, heads, hd), cos, sin), None, want_k,
                                  want_v, session, position, window, *tables)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="slot id out of range"):
        kernel.rope_write_attend(qkv, cos, sin, got_k, got_v, slots + k_cache.shape[1], heads,
                                 session, position, window, *tables)


def test_bundled_model_decodes_the_same_tokens_on_both_paths(smollm2, paged_kernel):
    """Real text, a bound that slides during decode: greedy tokens equal, logits close."""
    from metronome.model.weights import load_tokenizer

    paged_kernel()
    tokenizer = load_tokenizer()
    ids = tokenizer.encode("To be, or not to be, that is the question: whether 'tis nobler "
                           "in the mind to suffer the slings and arrows").ids
    results = {}
    for attention in ("dense", "paged"):
        engine = Engine(smollm2, EngineConfig(block_size=16, pool_tokens=4096,
                                              attention=attention))
        sid = engine.open_session(Stream.of(SessionSpec(
            policy=ResidencyPolicy.sinks_window(4, 32), stop_token_ids=(), return_logits=True)))
        engine.submit(sid, ids, max_new_tokens=40)
        tokens, logits = [], []
        while engine.has_work:
            for step in by_session(engine.step()).values():
                tokens += step.new_token_ids
                logits.append(step.logits[-1])
        results[attention] = (tokens, torch.stack(logits))
    assert results["dense"][0] == results["paged"][0]
    torch.testing.assert_close(results["paged"][1], results["dense"][1], atol=2e-3, rtol=1e-3)


def test_packed_projections_match_plain_linear(tiny_model):
    model = random_model(TINY_LLAMA, torch.float32, seed=4)
    assert model.packed_linear, "float32 projections are prepacked wherever oneDNN is built in"
    x = torch.randn(7, model.config.hidden_size)
    for packed, plain in ((model.projections[0].qkv, torch.nn.functional.linear(
            x, model.layers[0].qkv, model.layers[0].qkv_bias)),
            (model.lm_head_projection, torch.nn.functional.linear(x, model.lm_head))):
        torch.testing.assert_close(packed(x), plain, atol=1e-5, rtol=1e-5)
    assert model.lm_head_projection(x[:0]).shape == (0, model.config.vocab_size)
    runs = {}
    for enabled in (True, False):
        model.use_packed_linear(enabled)
        runs[enabled] = churned_run(model, "dense", 0, seed=2, rounds=6)
    model.use_packed_linear(True)
    for (_, want, t1), (_, got, t2) in zip(runs[False], runs[True], strict=True):
        assert t1 == t2
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kernel_refuses_bad_shapes_with_a_reason(paged_kernel):
    kernel = paged_kernel()
    q = torch.randn(2, 4, 8)
    kv = torch.zeros(2, 16, 8)
    ints = torch.zeros(2, dtype=torch.int64)
    tables = torch.zeros(2, 1, dtype=torch.int64)
    good = (q, None, kv, kv, ints, ints, ints, tables, tables, torch.ones(2, dtype=torch.int64),
            ints, ints, 4, 0.5)
    assert kernel.paged_attention(*good).shape == (2, 32)
    bad = {
        "q must be contiguous": (q.transpose(0, 1),),
        "share a dtype": (q.double(),),
        "query heads must be a multiple": (torch.randn(2, 3, 8),),
        "slots must be whole blocks": (q, None, torch.zeros(2, 15, 8), torch.zeros(2, 15, 8)),
        "per-token tensors": (q, None, kv, kv, ints[:1]),
    }
    for reason, head in bad.items():
        with pytest.raises(RuntimeError, match=reason):
            kernel.paged_attention(*head, *good[len(head):])


def test_engine_config_refuses_an_unknown_attention_mode():
    with pytest.raises(ValueError, match="attention must be one of auto, paged, dense"):
        EngineConfig(attention="flash")
    with pytest.raises(ValueError, match="paged_max_chunk_tokens must be >= 0"):
        EngineConfig(paged_max_chunk_tokens=-1)


def test_without_the_kernel_auto_falls_back_and_paged_says_why(monkeypatch, tiny_model):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    monkeypatch.setattr(native.PAGED, "_state", {})
    assert native.kernel() is None
    assert "disabled by METRONOME_NATIVE_ATTENTION=0" in native.unavailable_reason()
    engine = Engine(tiny_model, EngineConfig(block_size=4, pool_tokens=256))
    assert engine.kernel is None and engine.paged_max_chunk_tokens == 0
    sid = engine.open_session(Stream.of(SessionSpec(stop_token_ids=())))
    engine.submit(sid, [1, 2, 3], max_new_tokens=2)
    while engine.has_work:
        engine.step()
    assert engine.sessions[sid].table.num_tokens == 4  # 3 input + 1 fed-back sampled token
    with pytest.raises(RuntimeError, match="attention='paged' but disabled by"):
        Engine(tiny_model, EngineConfig(block_size=4, pool_tokens=256, attention="paged"))


def test_the_build_cache_is_named_after_this_cpu():
    assert native.build_dir().name == f"paged_attention_{native._cpu_tag()}"
    assert len(native._cpu_tag()) == 10


def test_engine_paths_select_the_fast_or_the_reference_code():
    from metronome.engine.engine import for_engine_path
    from metronome.sim.local import RunConfig

    model = random_model(TINY_LLAMA, torch.float32, seed=4)
    base = EngineConfig(block_size=4, pool_tokens=256)
    reference = for_engine_path(model, base, "reference")
    assert reference.attention == "dense" and not model.packed_linear
    assert model.fused is None, "the reference path runs torch's elementwise ops"
    fast = for_engine_path(model, base, "fast")
    assert fast.attention == "auto" and model.packed_linear
    assert model.fused is native.fused_ops()
    with pytest.raises(ValueError, match="engine path must be one of fast, reference"):
        for_engine_path(model, base, "turbo")
    with pytest.raises(ValueError, match="engine_path must be one of fast, reference"):
        RunConfig(engine_path="turbo")


def test_a_killed_builds_lock_does_not_hang_the_next(tmp_path, caplog):
    """torch's cpp_extension waits for ever on the `lock` file a killed build leaves; the
    build lock (which every build takes first) clears it, says so, and is exclusive."""
    import fcntl

    (tmp_path / "lock").write_text("")
    with caplog.at_level("WARNING"), native.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "metronome.lock") as other:  # held: a second builder waits
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert "killed mid-way" in caplog.text
    with native.build_lock(tmp_path):  # released after, and nothing to clear
        pass
