"""The few-row projection kernel against oneDNN's prepacked linear, by row count, on this CPU.

`gemm_peak_gflops` at each `--rows`, the kernel taken at any row count: every
weight a decode step multiplies by (the bundled model's 30 layers' qkv, o, gate_up and down,
and lm_head) in a row, so the weights come from memory as in a step, each way best of
`--repeats` after a warm-up, in the model's dtype on this machine (`--dtype`, else `auto`).
What `model.linear.SMALL_ROWS_MAX` (and its split-FMA row limit) were set from.

    flock /tmp/cpu.lock .venv/bin/python scripts/few_rows.py --rows 8 16 24 32 40 48 64
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from metronome.model.dtypes import DTYPE_NAMES, resolve_dtype
from metronome.model.linear import Projection, small_rows_max, split_fma
from metronome.model.weights import load_model


def linear_weights(model) -> list[torch.Tensor]:
    """Every weight a decode step multiplies by, in order (lm_head last)."""
    weights = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return weights + [model.lm_head]


def gemm_peak_gflops(model, rows: int, repeats: int = 5, past_limit: bool = False) -> dict:
    """torch's best throughput for the step's GEMM shapes at `rows` rows (every weight of
    `linear_weights`), with F.linear on the plain weights and oneDNN on prepacked ones, all in
    a row (weights from memory, as in a step), best of `repeats` after one warm-up; and the
    few-row kernel where it applies (`past_limit`: at any row count)."""
    weights = linear_weights(model)
    flops = 2 * rows * sum(w.numel() for w in weights)
    plain = [Projection(w, None, False) for w in weights]
    packed = [Projection(w, None, True) for w in weights]
    ways = {"f_linear": plain, "onednn_prepacked": [p.onednn for p in packed]}
    if all(p.small is not None for p in packed):
        if rows <= small_rows_max(model.dtype):
            ways["small_linear"] = packed  # (Projection's own choice at these rows)
        elif past_limit:
            ways["small_linear"] = [functools.partial(p.small.small_linear, w=p.small_weight,
                                                      bias=None, out_features=p.out_features)
                                    for p in packed]
    inputs = [torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights]
    out = {}
    for name, products in ways.items():
        best = float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            for product, x in zip(products, inputs, strict=True):
                product(x)
            best = min(best, time.perf_counter() - t0)
        out[name] = flops / best / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32, 40, 48, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="auto")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)
    model = load_model("bundled", dtype)
    print(f"{dtype}, torch on {torch.get_num_threads()} threads; split FMA: {split_fma()}, "
          f"the engine's few-row limit here: {small_rows_max(dtype)} rows")
    for rows in args.rows:
        gflops = gemm_peak_gflops(model, rows, args.repeats, past_limit=True)
        if "small_linear" not in gflops:
            raise SystemExit(f"the few-row kernel does not run {dtype} on this CPU")
        kernel, onednn = gflops["small_linear"], gflops["onednn_prepacked"]
        print(f"{rows:4d} rows: GFLOP/s kernel {kernel:5.1f}, oneDNN {onednn:5.1f}, F.linear "
              f"{gflops['f_linear']:5.1f}; oneDNN / kernel time {kernel / onednn:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
