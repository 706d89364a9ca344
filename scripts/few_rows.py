"""The few-row projection kernel against oneDNN's prepacked linear, by row count, on this CPU.

`bench.vllm.pair.gemm_peak_gflops` at each `--rows`, the kernel taken at any row count: every
weight a decode step multiplies by (the bundled model's 30 layers' qkv, o, gate_up and down,
and lm_head) in a row, so the weights come from memory as in a step, each way best of
`--repeats` after a warm-up, in the model's dtype on this machine (`--dtype`, else `auto`).
What `model.linear.SMALL_ROWS_MAX` (and its split-FMA row limit) were set from.

    flock /tmp/cpu.lock .venv/bin/python scripts/few_rows.py --rows 8 16 24 32 40 48 64
"""

from __future__ import annotations

import argparse

import torch

from metronome.bench.vllm.pair import gemm_peak_gflops
from metronome.model.dtypes import DTYPE_NAMES, resolve_dtype
from metronome.model.linear import small_rows_max, split_fma
from metronome.model.weights import load_model


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
