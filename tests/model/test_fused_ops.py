"""The fused elementwise kernels (`csrc/fused_ops.cpp`) against torch's ops they replace:
RMSNorm (alone and after the residual add), SiLU-and-multiply, rotate-half RoPE. In bf16 they
round every intermediate as torch's ops do, so they agree to the bit but for a rare rounding
flip from a different summation order; in float32 to float rounding. Then the whole model
with them on and off, and their refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metronome.model import native, rope
from metronome.model.config import TINY_LLAMA
from metronome.model.llama import rms_norm
from metronome.model.weights import random_model
from tests.model.test_paged_attention import churned_run


@pytest.fixture(scope="module")
def fused():
    module = native.fused_ops()
    if module is None:
        import os

        if os.environ.get(native.DISABLE_ENV) == "0":
            pytest.skip(native.FUSED.reason())
        pytest.fail(f"the fused kernels did not build: {native.FUSED.reason()}")
    return module


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16: equal but for at most 1 in 10,000 values one ulp apart; float32: close."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.bfloat16:
        differ = got != want
        assert differ.float().mean().item() <= 1e-4, f"{int(differ.sum())} values differ"
        ulp = want.float().abs().clamp_min(1e-30) * 2**-7
        assert bool(((got.float() - want.float()).abs() <= ulp).all())
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_each_kernel_matches_the_torch_ops_it_replaces(fused, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    hidden, inter, heads, hd = 96, 160, 6, 16

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    x, d, w = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    assert_same(fused.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))
    total, normed = fused.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(total, x + d)
    assert_same(normed, rms_norm(x + d, w, 1e-5))
    gate_up = rand(rows, 2 * inter)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_same(fused.silu_mul(gate_up), F.silu(gate) * up)
    # q and k as the model has them: strided views of one fused qkv row
    qkv = rand(rows, 3 * heads * hd)
    q = qkv[:, : heads * hd].view(rows, heads, hd)
    k = qkv[:, heads * hd: 2 * heads * hd].view(rows, heads, hd)
    positions = torch.randint(0, 100_000, (rows,), generator=g)
    cos, sin = rope.cos_sin(positions, rope.inv_frequencies(hd, 10_000.0), dtype)
    for part in (q, k):
        assert rows == 1 or not part.is_contiguous()
        assert_same(fused.rope(part, cos, sin), rope.apply(part, cos, sin))
    # strided rows for the norms too (a view into a wider buffer)
    wide = rand(rows, 2 * hidden)[:, :hidden]
    assert_same(fused.rms_norm(wide, w, 1e-5), rms_norm(wide, w, 1e-5))


def test_the_model_gives_the_same_tokens_and_logits_with_and_without_them(fused):
    model = random_model(TINY_LLAMA, torch.bfloat16, seed=3)
    assert model.fused is fused, "the fast path uses the fused kernels where they build"
    runs = {}
    for enabled in (True, False):
        model.use_fused_ops(enabled)
        runs[enabled] = churned_run(model, "auto", 16, seed=5, rounds=6)
    model.use_fused_ops(True)
    assert len(runs[True]) == len(runs[False])
    for (_, want, t1), (_, got, t2) in zip(runs[False], runs[True], strict=True):
        assert t1 == t2
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


def test_they_refuse_bad_shapes_with_a_reason(fused):
    x = torch.randn(4, 8)
    cases = {
        "x must be \\(T, H\\)": lambda: fused.rms_norm(x.t(), torch.randn(4), 1e-5),
        "weight must be contiguous": lambda: fused.rms_norm(x, torch.randn(9), 1e-5),
        "share a dtype": lambda: fused.rms_norm(x, torch.randn(8).double(), 1e-5),
        "the addend must match": lambda: fused.add_rms_norm(x, torch.randn(4, 9),
                                                            torch.randn(8), 1e-5),
        "gate_up must be": lambda: fused.silu_mul(torch.randn(4, 7)),
        "D even": lambda: fused.rope(torch.randn(4, 2, 7), torch.randn(4, 1, 7),
                                     torch.randn(4, 1, 7)),
        "cos and sin must be": lambda: fused.rope(torch.randn(4, 2, 8), torch.randn(3, 1, 8),
                                                  torch.randn(4, 1, 8)),
    }
    for reason, call in cases.items():
        with pytest.raises(RuntimeError, match=reason):
            call()


def test_argmax_rows_is_torchs_argmax(fused):
    """The first maximal index of every row, NaN counting as the maximum: rows of every
    length around the 8-lane vectors, ties within and across lanes, -0.0 beside 0.0, NaNs
    in the vector part and in the tail, and a step's logits (8 x the vocabulary)."""
    from metronome.engine.sampling import greedy_ids

    generator = torch.Generator().manual_seed(3)
    rows = [torch.randn(n, generator=generator) for n in range(1, 50)]
    rows += [torch.randint(0, 3, (n,), generator=generator).float() for n in (7, 16, 17, 64, 99)]
    rows += [torch.tensor([-0.0, 0.0, -0.0] * 7), torch.full((40,), -1e30)]
    for n, at in ((9, 0), (30, 12), (30, 29), (33, 32), (5, 3)):
        row = torch.randn(n, generator=generator)
        row[at] = float("nan")
        rows.append(row)
        twice = row.clone()
        twice[-1] = float("nan")
        rows.append(twice)
    rows.append(torch.full((24,), float("-inf")))
    for row in rows:
        got = fused.argmax_rows(row[None].contiguous()).tolist()
        assert got == row[None].argmax(dim=-1).tolist(), row
    step = torch.randn(8, 49152, generator=generator)
    step[3, 40000] = step[3, 100] = step[3].max() + 1  # a tie: the first wins
    assert fused.argmax_rows(step).tolist() == step.argmax(dim=-1).tolist()
    assert greedy_ids(step, fused) == greedy_ids(step, None) == step.argmax(dim=-1).tolist()
    assert greedy_ids(step[:, :100], fused) == step[:, :100].argmax(dim=-1).tolist()  # strided
    assert greedy_ids(torch.empty(0, 10), fused) == []
    with pytest.raises(RuntimeError, match="float32"):
        fused.argmax_rows(step.to(torch.bfloat16))
