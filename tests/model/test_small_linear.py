"""The few-row projection kernel (`csrc/small_linear.cpp`) against exact products of the same
operands, in bf16 (AVX512-BF16) and float32 (AVX2 with FMA): row counts 1-8 (each micro-tile
size) and past them (whole tiles and a rest), an odd number of outputs (the last weight row
alone), K not a multiple of the vector width (the masked tail), a bias; each row's result
does not depend on the rows beside it; and `Projection` sends a packed product of at most
`small_rows_max(dtype)` rows to it, more rows to oneDNN, and the reference to `F.linear`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metronome.model import linear
from metronome.model.linear import (
    SMALL_ROWS_MAX,
    SPLIT_FMA_FLOAT32_ROWS_MAX,
    Projection,
    small_rows_max,
    splits_fma,
)
from tests.native_kernels import bf16_kernel, float32_kernel


@pytest.fixture(scope="module")
def small():
    from metronome.model import native

    return bf16_kernel(native.SMALL_LINEAR, "few-row projection kernel",
                       "projections run on oneDNN")


def _operands(rows: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    return x, w, b


def _exact(x, w, b=None):
    """float32 products of the bf16 operands, rounded to bf16 once (what the kernel does,
    up to the order of its float32 sums)."""
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).bfloat16()


@pytest.mark.parametrize(("n", "k"), [(64, 576), (33, 576), (96, 100), (7, 31), (1536, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 17])
def test_matches_exact_products(small, rows, n, k):
    x, w, b = _operands(rows, n, k, seed=rows * 1000 + n + k)
    for bias in (None, b):
        got = small.small_linear(x, w, bias)
        want = _exact(x, w, bias)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        # one bf16 rounding apart at most (float32 sums in another order)
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_a_row_does_not_depend_on_the_rows_beside_it(small):
    x, w, _ = _operands(13, 96, 576, seed=7)
    alone = torch.cat([small.small_linear(x[i:i + 1].contiguous(), w) for i in range(13)])
    assert torch.equal(small.small_linear(x, w), alone)


@pytest.mark.parametrize(("n", "k"), [(64, 576), (33, 576), (96, 100), (7, 31), (1, 32)])
def test_the_packed_weight_gives_the_plain_weights_bits(small, n, k):
    """What `Projection` runs (the weight packed once) against the plain weight (packed for
    the call): the same bits, odd row counts and K short of a whole piece included."""
    x, w, b = _operands(8, n, k, seed=n + k)
    packed = small.pack_bf16(w)
    assert packed.shape == ((n + 1) // 2, (k + 31) // 32, 2, 32)
    for rows in (1, 3, 8):
        for bias in (None, b):
            assert torch.equal(small.small_linear(x[:rows], packed, bias, n),
                               small.small_linear(x[:rows], w, bias))


def test_a_packed_weight_needs_its_row_count(small):
    x, w, _ = _operands(2, 9, 64, seed=2)
    packed = small.pack_bf16(w)
    for wrong in (-1, 8, 11):
        with pytest.raises(RuntimeError, match="pack_bf16"):
            small.small_linear(x, packed, None, wrong)
    with pytest.raises(RuntimeError, match="pack_bf16"):  # packed for another K
        small.small_linear(torch.cat([x, x], 1), packed, None, 9)
    with pytest.raises(RuntimeError, match="out_features"):
        small.small_linear(x, w, None, 8)


def test_bad_operands_are_refused(small):
    x, w, b = _operands(2, 8, 64, seed=1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        small.small_linear(x.float(), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        small.small_linear(torch.cat([x, x], 1)[:, ::2], w)
    with pytest.raises(RuntimeError, match="bias"):
        small.small_linear(x, w, b[:4].contiguous())
    with pytest.raises(RuntimeError, match=r"\(M, K\)"):
        small.small_linear(x, w[:, :32].contiguous())


def _spied_projection(w, b, module, monkeypatch):
    """A packed Projection whose few-row kernel calls go through `module`, and the row
    counts of those calls."""
    packed = Projection(w, b, packed=True)
    assert packed.small is not None
    calls = []

    class Spy:
        def small_linear(self, *args):
            calls.append(args[0].shape[0])
            return module.small_linear(*args)

    monkeypatch.setattr(packed, "small", Spy())
    return packed, calls


def test_projection_chooses_by_rows(small, monkeypatch):
    most = small_rows_max(torch.bfloat16)
    x, w, b = _operands(most + 4, 96, 576, seed=3)
    packed, calls = _spied_projection(w, b, small, monkeypatch)
    for rows in (1, most, most + 1):
        torch.testing.assert_close(packed(x[:rows]).float(), _exact(x[:rows], w, b).float(),
                                   rtol=2**-7, atol=1e-2)
    assert calls == [1, most]  # past small_rows_max: oneDNN
    assert packed.small_weight.shape == small.pack_bf16(w).shape  # packed once, at init
    reference = Projection(w, b, packed=False)
    assert reference.small is None
    assert torch.equal(reference(x[:2]), F.linear(x[:2], w, b))
    assert most >= 1


@pytest.fixture(scope="module")
def small_f32():
    from metronome.model import native

    return float32_kernel(native.SMALL_LINEAR, "few-row projection kernel",
                          "float32 projections run on oneDNN")


def _operands_f32(rows: int, n: int, k: int, seed: int):
    return tuple(t.float() for t in _operands(rows, n, k, seed))


@pytest.mark.parametrize(("n", "k"), [(64, 576), (33, 576), (96, 100), (7, 5), (1536, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 24, 33, 64])  # to the split-FMA limit
def test_float32_matches_exact_products(small_f32, rows, n, k):
    x, w, b = _operands_f32(rows, n, k, seed=rows * 1000 + n + k)
    for bias in (None, b):
        got = small_f32.small_linear(x, w, bias)
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        assert got.shape == (rows, n) and got.dtype == torch.float32
        # float32 sums in another order than the exact one: a few ulp of the terms' size
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)


def test_float32_row_does_not_depend_on_the_rows_beside_it(small_f32):
    x, w, _ = _operands_f32(13, 96, 576, seed=8)
    alone = torch.cat([small_f32.small_linear(x[i:i + 1].contiguous(), w) for i in range(13)])
    assert torch.equal(small_f32.small_linear(x, w), alone)


def test_mixed_dtypes_are_refused(small_f32):
    x, w, b = _operands_f32(2, 8, 64, seed=1)
    with pytest.raises(RuntimeError, match="both be bfloat16 or both float32"):
        small_f32.small_linear(x, w.bfloat16())
    with pytest.raises(RuntimeError, match="bias"):
        small_f32.small_linear(x, w, b.bfloat16())


def test_float32_projection_chooses_by_rows(small_f32, monkeypatch):
    most = small_rows_max(torch.float32)
    x, w, b = _operands_f32(most + 4, 96, 576, seed=3)
    packed, calls = _spied_projection(w, b, small_f32, monkeypatch)
    for rows in (1, most, most + 1):
        torch.testing.assert_close(packed(x[:rows]), F.linear(x[:rows], w, b), rtol=1e-5,
                                   atol=1e-5)
    assert calls == [1, most]  # past small_rows_max: oneDNN
    assert packed(x[:2].bfloat16().float()).dtype == torch.float32
    assert Projection(w, b, packed=False).small is None


def test_the_kernel_runs_without_the_gil(small_f32):
    """A projection on the engine's thread must not stop the server's event loop: while long
    calls run in another thread, this thread keeps running Python within them (with the GIL
    held it could not tick once between a call's start and its end). Asked of the middle
    half of each of 5 calls, 3 at least: the host may take this thread off a core for a few
    ms (a 6-7 ms gap in 2 runs of 4 around a ~9 ms call on a 2-core VM, when one call's
    largest gap was asked to stay under half the call), never for most of 5 calls."""
    import bisect
    import threading
    import time

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(8, 4096, generator=g), torch.randn(16384, 4096, generator=g)
    small_f32.small_linear(x, w)  # warm: pages touched, threads up
    go = threading.Event()
    calls: list[tuple[float, float]] = []  # each call's (start, end)

    def project():
        go.wait()
        for _ in range(5):
            started = time.perf_counter()
            small_f32.small_linear(x, w)
            calls.append((started, time.perf_counter()))

    worker = threading.Thread(target=project)
    worker.start()
    ticks = [time.perf_counter()]
    go.set()  # from here this thread ticks, before, during and after the calls
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    ticked_within = [bisect.bisect_left(ticks, end - (end - start) / 4)
                     - bisect.bisect_right(ticks, start + (end - start) / 4)
                     for start, end in calls]
    assert sum(n > 0 for n in ticked_within) >= 3, (ticked_within, calls)


ZEN1 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"


@pytest.mark.parametrize(("cpuinfo", "split"), [
    (ZEN1, True),
    (ZEN1.replace("model\t\t: 1", "model\t\t: 8"), True),  # Zen+
    (ZEN1.replace("model\t\t: 1", "model\t\t: 49"), False),  # Zen 2: full-width FMA
    (ZEN1.replace("23", "25"), False),  # Zen 3 and 4
    (ZEN1.replace("AuthenticAMD", "GenuineIntel").replace("23", "6"), False),
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\n", False),  # no family: not assumed
    ("", False),
    (ZEN1.replace("AuthenticAMD", "GenuineIntel") + "\n" + ZEN1, False),  # the first CPU's
])
def test_split_fma_is_amd_family_23_before_model_0x30(cpuinfo, split):
    assert splits_fma(cpuinfo.splitlines()) is split


@pytest.mark.parametrize(("split", "rows"), [(True, SPLIT_FMA_FLOAT32_ROWS_MAX),
                                             (False, SMALL_ROWS_MAX[torch.float32])])
def test_float32_row_limit_follows_the_fma_width(monkeypatch, split, rows):
    monkeypatch.setattr(linear, "split_fma", lambda: split)
    assert small_rows_max(torch.float32) == rows
    assert small_rows_max(torch.bfloat16) == SMALL_ROWS_MAX[torch.bfloat16]  # bf16: as it was
