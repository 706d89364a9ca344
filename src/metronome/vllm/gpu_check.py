"""The GPU check of the sinks+window bound on vLLM's Triton attention (issue 20).

Runs vLLM 0.32's own Triton unified-attention kernel (`metronome.vllm.triton_sources`: its
sources copied out of the wheel, so no vLLM install is needed where this runs) three ways
on paged KV whose gap entries point at stale or garbage blocks:

* `rswa`    R-SWA with every request's prefix at S (what `metronome.vllm.gpu_metadata`
            feeds the stock Triton build) over the full block table: exact, O(L) tiles;
* `compact` the same over the compacted table (`metronome.vllm.compaction`): exact, O(S+W);
            its gap blocks are filled with NaN, which any read would turn into NaN output;
* `window`  vLLM's plain sliding window of S + W tokens (no sinks): the cost to match;
* `flex`    torch's flex_attention with our paged block mask (`metronome.vllm.flex_mask`:
            what vLLM's Flex backend builds with the prefix at S), compiled on the GPU.

Correctness: decode rows, 16- and 64-token chunks and a mixed batch, at lengths below S + W,
with the window starting inside / right after the sink block, and far past, against an fp32
dense reference built from the same cache values. Timing (GPU only): decode, one layer with
7B-like attention shapes, N x L in {8, 64, 256} x {1k, 4k, 32k}.

    python scripts/gpu_check.py --prepare          # in .venv-vllm: copy the kernel sources
    python scripts/gpu_check.py --dry-run          # CPU, Triton's interpreter, tiny shapes
    python scripts/gpu_check.py                    # on the GPU: correctness + timing

It writes `gpu_check.json` and `gpu_check.md` to `--out`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from metronome.results.provenance import git_commit

SINK_TOKENS = 4
WINDOW_TOKENS = 512
BLOCK_SIZE = 16
GARBAGE_BLOCKS = 4  # blocks 0..3: vLLM's null block and stale ones; gap entries point here
MIN_LAUNCH_GRID_SIZE_2D = 128  # vLLM 0.32 triton_attn.py: the 3D (split-softmax) decode
NUM_PAR_SOFTMAX_SEGMENTS = 16  # path's threshold and segment count, as its builder sets


@dataclass(frozen=True)
class Shapes:
    heads: int
    kv_heads: int
    head_size: int
    sink_tokens: int
    window_tokens: int
    block_size: int
    dtype: str


GPU_SHAPES = Shapes(32, 8, 128, SINK_TOKENS, WINDOW_TOKENS, BLOCK_SIZE, "bfloat16")  # 7B-like
DRY_SHAPES = Shapes(4, 2, 32, SINK_TOKENS, 32, BLOCK_SIZE, "float32")  # the interpreter's


def correctness_cases(shapes: Shapes) -> dict[str, list[tuple[int, int]]]:
    """(sequence length incl. this step's queries, query tokens) per request, per case."""
    s, w, bs = shapes.sink_tokens, shapes.window_tokens, shapes.block_size
    sink_span = math.ceil(s / bs) * bs
    lengths = [s + w - 3,              # shorter than S + W: plain causal
               s + w + 5,              # window starts inside the sink block
               sink_span + w + bs,     # window starts right after the sink block
               3 * (s + w) + 7,        # far past: a gap of several blocks
               9 * (s + w) + 1]
    return {
        "decode": [(n, 1) for n in lengths],
        "chunk16": [(n + 16, 16) for n in lengths],
        "chunk64": [(n + 64, 64) for n in lengths],
        "mixed": [(lengths[3], 1), (lengths[1] + 16, 16), (lengths[0], 1), (lengths[4] + 16, 16),
                  (lengths[2], 1)],
    }


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Batch:
    """One step's queries and a paged cache: each request's sink blocks and the blocks its
    queries' windows (and a plain S + W window) can reach are live; every other table entry
    points at one of the garbage blocks."""

    def __init__(self, torch, shapes: Shapes, requests: list[tuple[int, int]], device,
                 gap_fill: float, generator) -> None:
        dtype = getattr(torch, shapes.dtype)
        bs, s, w = shapes.block_size, shapes.sink_tokens, shapes.window_tokens
        self.shapes, self.requests = shapes, requests
        width = max(ceil_div(n, bs) for n, _ in requests)
        live: list[list[int]] = []
        for seq_len, q_len in requests:
            first = seq_len - q_len
            reach = max(0, first - (s + w) + 1)  # the plain window reaches furthest back
            blocks = range(ceil_div(seq_len, bs))
            live.append([b for b in blocks if b < ceil_div(s, bs) or b >= reach // bs])
        num_blocks = GARBAGE_BLOCKS + sum(len(x) for x in live)
        cache = (num_blocks, bs, shapes.kv_heads, shapes.head_size)
        self.k = torch.randn(cache, generator=generator, device=device).to(dtype)
        self.v = torch.randn(cache, generator=generator, device=device).to(dtype)
        self.k[:GARBAGE_BLOCKS] = gap_fill
        self.v[:GARBAGE_BLOCKS] = gap_fill
        table = torch.randint(0, GARBAGE_BLOCKS, (len(requests), width), generator=generator,
                              device=device, dtype=torch.int32)
        next_block = GARBAGE_BLOCKS
        for r, blocks in enumerate(live):
            ids = torch.arange(next_block, next_block + len(blocks), dtype=torch.int32)
            table[r, torch.tensor(blocks, dtype=torch.long)] = ids.to(device)
            next_block += len(blocks)
        self.block_table = table
        self.seq_lens = torch.tensor([n for n, _ in requests], dtype=torch.int32, device=device)
        q_lens = [q for _, q in requests]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
        self.q = torch.randn((starts[-1], shapes.heads, shapes.head_size), generator=generator,
                             device=device).to(dtype)
        self.max_query_len = max(q_lens)
        self.max_seq_len = max(n for n, _ in requests)
        self.scale = shapes.head_size ** -0.5


def reference(torch, batch: Batch):
    """fp32 dense attention from the cache values, each query's visible set from the rule
    j <= p and (j < S or p - j < W), the keys read through the table's live entries only."""
    sh = batch.shapes
    bs, s, w = sh.block_size, sh.sink_tokens, sh.window_tokens
    group = sh.heads // sh.kv_heads
    out = torch.empty(batch.q.shape, dtype=torch.float32, device=batch.q.device)
    starts = batch.query_start_loc.tolist()
    for r, (seq_len, q_len) in enumerate(batch.requests):
        first = seq_len - q_len
        keys = list(range(min(s, seq_len))) + list(range(max(s, first - w + 1), seq_len))
        positions = torch.tensor(keys, device=batch.q.device)
        blocks = batch.block_table[r, positions // bs].long()
        k = batch.k[blocks, positions % bs].float().repeat_interleave(group, dim=1)  # (n,H,D)
        v = batch.v[blocks, positions % bs].float().repeat_interleave(group, dim=1)
        query_pos = torch.arange(first, seq_len, device=batch.q.device)[:, None]
        visible = (positions[None, :] <= query_pos) & (
            (positions[None, :] < s) | (query_pos - positions[None, :] < w))
        q = batch.q[starts[r]: starts[r + 1]].float()  # (q, H, D)
        scores = torch.einsum("qhd,nhd->hqn", q, k) * batch.scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[starts[r]: starts[r + 1]] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v)
    return out


class TritonRunner:
    """vLLM's `unified_attention` with its builder's scratch (3D decode path included)."""

    def __init__(self, torch, unified_attention, shapes: Shapes, max_tokens: int, device):
        self.torch, self.ua, self.shapes = torch, unified_attention, shapes
        self.seq_threshold_3d = MIN_LAUNCH_GRID_SIZE_2D // shapes.kv_heads
        rows, heads = self.seq_threshold_3d, shapes.heads
        padded = 1 << (shapes.head_size - 1).bit_length()
        f32 = torch.float32
        self.segm_output = torch.empty((rows, heads, NUM_PAR_SOFTMAX_SEGMENTS, padded),
                                       dtype=f32, device=device)
        self.segm_max = torch.empty((rows, heads, NUM_PAR_SOFTMAX_SEGMENTS), dtype=f32,
                                    device=device)
        self.segm_expsum = torch.empty_like(self.segm_max)
        self.prefix_lens = torch.full((max_tokens,), shapes.sink_tokens, dtype=torch.int32,
                                      device=device)
        self.compact_table: torch.Tensor | None = None
        self.compact_lens = torch.zeros(max_tokens, dtype=torch.int32, device=device)

    def compacted(self, batch: Batch):
        from metronome.vllm.compaction import compact_block_table, max_compacted_len

        sh = self.shapes
        if self.compact_table is None or self.compact_table.shape != batch.block_table.shape:
            self.compact_table = self.torch.zeros_like(batch.block_table)
        table, lens = compact_block_table(
            batch.block_table, batch.seq_lens, batch.query_start_loc, sh.sink_tokens,
            sh.window_tokens, sh.block_size, self.compact_table, self.compact_lens)
        bound = max_compacted_len(batch.max_seq_len, batch.max_query_len, sh.sink_tokens,
                                  sh.window_tokens, sh.block_size)
        return table, lens, bound

    def flex(self, batch: Batch, block_mask=None):
        """torch's flex_attention with our paged sinks+window block mask (compiled on GPUs)."""
        from metronome.vllm.flex_mask import flex_paged_attention, paged_block_mask

        sh = self.shapes
        if block_mask is None:
            block_mask = paged_block_mask(batch.block_table, batch.seq_lens,
                                          batch.query_start_loc, sh.sink_tokens,
                                          sh.window_tokens, sh.block_size, batch.k.shape[0])
        return flex_paged_attention(self.flex_attention, batch.q, batch.k, batch.v, block_mask,
                                    batch.scale)

    @property
    def flex_attention(self):
        if getattr(self, "_flex", None) is None:
            from torch.nn.attention.flex_attention import flex_attention

            on_gpu = self.segm_max.is_cuda
            if on_gpu:  # every new shape compiles again; past dynamo's default limit (8)
                # it would quietly fall back to eager flex and time that instead
                self.torch._dynamo.config.recompile_limit = 256
            self._flex = self.torch.compile(flex_attention, dynamic=False) if on_gpu else (
                flex_attention)
        return self._flex

    def __call__(self, batch: Batch, mode: str, out=None, compacted=None):
        sh = self.shapes
        table, lens, max_len = batch.block_table, batch.seq_lens, batch.max_seq_len
        if mode == "compact":
            table, lens, max_len = compacted or self.compacted(batch)
        window = (sh.sink_tokens + sh.window_tokens - 1, 0) if mode == "window" else (-1, -1)
        rswa = mode in ("rswa", "compact")
        out = self.torch.empty_like(batch.q) if out is None else out
        self.ua(q=batch.q, k=batch.k, v=batch.v, out=out, cu_seqlens_q=batch.query_start_loc,
                max_seqlen_q=batch.max_query_len, seqused_k=lens, max_seqlen_k=max_len,
                softmax_scale=batch.scale, causal=True, window_size=window, block_table=table,
                softcap=0, q_descale=None, k_descale=None, v_descale=None,
                seq_threshold_3D=self.seq_threshold_3d,
                num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS,
                softmax_segm_output=self.segm_output, softmax_segm_max=self.segm_max,
                softmax_segm_expsum=self.segm_expsum,
                rswa_prefix_lens=self.prefix_lens[: len(batch.requests)] if rswa else None,
                rswa_window=sh.window_tokens if rswa else None)
        return out


def check_correctness(torch, runner: TritonRunner, shapes: Shapes, device, tolerance: float,
                      log) -> list[dict]:
    rows = []
    generator = torch.Generator(device=device).manual_seed(0)
    # eager flex (CPU) computes the whole grid, so a NaN anywhere would reach every output;
    # compiled flex on a GPU reads only the listed pages, like the compacted Triton call
    flex_fill = float("nan") if device.type == "cuda" else 1e3
    for case, requests in correctness_cases(shapes).items():
        for mode, fill in (("rswa", 1e3), ("compact", float("nan")), ("flex", flex_fill)):
            batch = Batch(torch, shapes, requests, device, fill, generator)
            expected = reference(torch, batch)
            row = {"case": case, "mode": mode, "gap_blocks": "nan" if fill != fill
                   else "finite garbage", "requests": requests, "tolerance": tolerance}
            try:
                got = (runner.flex(batch) if mode == "flex" else runner(batch, mode)).float()
                error = (got - expected).abs().max().item()
            except Exception as failed:  # noqa: BLE001 - a GPU's Triton may differ: record it
                row["error"] = f"{type(failed).__name__}: {failed}"[:500]
                error = float("nan")
            ok = math.isfinite(error) and error <= tolerance
            rows.append(row | {"max_abs_error": error, "ok": ok})
            log(f"  {case:8s} {mode:8s} max |err| {error:.2e} {'ok' if ok else 'FAILED'}"
                + (f" ({row['error']})" if "error" in row else ""))
    return rows


def time_grid(torch, runner: TritonRunner, shapes: Shapes, device, sessions: list[int],
              lengths: list[int], repeats: int, log, flex_budget_s: float = 240.0
              ) -> list[dict]:
    rows = []
    generator = torch.Generator(device=device).manual_seed(1)
    on_gpu = device.type == "cuda"
    flex_until = time.monotonic() + flex_budget_s  # each new shape compiles flex anew
    for n in sessions:
        for length in lengths:
            batch = Batch(torch, shapes, [(length, 1)] * n, device, 1e3, generator)
            cells = {}
            arms = timed_arms(runner, batch, torch.empty_like(batch.q))
            if on_gpu and time.monotonic() < flex_until:
                arms["flex"] = flex_arm(runner, batch)
            for name, fn in arms.items():
                try:
                    cells[name] = median_ms(torch, fn, repeats, on_gpu)
                except Exception as failed:  # noqa: BLE001 - recorded, the grid goes on
                    cells[name] = float("nan")
                    log(f"  {name} failed at N={n} L={length}: {type(failed).__name__}: "
                        f"{str(failed)[:300]}")
            cells.setdefault("flex", float("nan"))  # not timed: CPU, or past its budget
            row = {"sessions": n, "tokens": length, **{f"{k}_ms": v for k, v in cells.items()},
                   "flex_over_window": cells["flex"] / cells["window"],
                   "rswa_over_window": cells["rswa"] / cells["window"],
                   "compact_over_window": cells["compact"] / cells["window"],
                   "compact_total_over_window": cells["compact_total"] / cells["window"]}
            rows.append(row)
            log(f"  N={n:4d} L={length:6d}: window {cells['window']:.3f} ms, rswa "
                f"{cells['rswa']:.3f} ms ({row['rswa_over_window']:.2f}x), compact "
                f"{cells['compact']:.3f} ms ({row['compact_over_window']:.2f}x; with the "
                f"compaction {row['compact_total_over_window']:.2f}x)")
    return rows


def timed_arms(runner: TritonRunner, batch: Batch, out) -> dict:
    """What the grid times per cell: each mode on the same batch, the compaction alone, and
    the compacted call with its compaction (what a step pays once per layer group)."""
    compacted = runner.compacted(batch)
    return {
        "window": lambda: runner(batch, "window", out),
        "rswa": lambda: runner(batch, "rswa", out),
        "compact": lambda: runner(batch, "compact", out, compacted),
        "compaction_only": lambda: runner.compacted(batch),
        "compact_total": lambda: runner(batch, "compact", out),
    }


def flex_arm(runner: TritonRunner, batch: Batch):
    """The flex call with its block mask built once (vLLM builds it once per step)."""
    from metronome.vllm.flex_mask import paged_block_mask

    sh = runner.shapes
    mask = paged_block_mask(batch.block_table, batch.seq_lens, batch.query_start_loc,
                            sh.sink_tokens, sh.window_tokens, sh.block_size, batch.k.shape[0])
    return lambda: runner.flex(batch, mask)


def median_ms(torch, fn, repeats: int, on_gpu: bool) -> float:
    """The median on a GPU; on CPU (the dry run's interpreter proxy) the fastest sample: the
    cost is what a call needs, and a busy host only ever adds to it (CI saw a median of 3 read
    one cell 1.5x slow beside other work)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - began) * 1e3)
    return statistics.median(samples) if on_gpu else min(samples)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def report(result: dict) -> str:
    lines = [f"# GPU check: sinks+window on vLLM's Triton attention ({result['mode']})", "",
             f"Command: `{result['command']}` (commit `{result.get('commit')}`)  ",
             f"Machine: {result['machine']}  ",
             f"Kernel: vLLM {result['kernel_source'].get('vllm_version')} "
             f"`triton_unified_attention.py`, Triton {result['triton']}, torch {result['torch']}  ",
             f"Shapes: {result['shapes']}", "", "## Correctness (vs fp32 dense reference)", "",
             "| case | mode | gap blocks | max abs error | ok |", "|---|---|---|---|---|"]
    for row in result["correctness"]:
        lines.append(f"| {row['case']} | {row['mode']} | {row['gap_blocks']} | "
                     f"{row['max_abs_error']:.2e} | {'yes' if row['ok'] else 'NO'} |")
    if result["timing"]:
        what = ("fastest interpreter ms: proportional to the tiles visited, not GPU time"
                if result["mode"].startswith("dry") else "median ms")
        lines += ["", f"## Decode, one layer: {what} (ratios to vLLM's plain S+W window)", "",
                  "| N | L | window | rswa (full table) | compact | compaction | flex | "
                  "rswa/window | compact/window | (compact+compaction)/window | flex/window |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["timing"]:
            lines.append(
                f"| {r['sessions']} | {r['tokens']} | {r['window_ms']:.3f} | {r['rswa_ms']:.3f} | "
                f"{r['compact_ms']:.3f} | {r['compaction_only_ms']:.3f} | {r['flex_ms']:.3f} | "
                f"{r['rswa_over_window']:.2f} | {r['compact_over_window']:.2f} | "
                f"{r['compact_total_over_window']:.2f} | {r['flex_over_window']:.2f} |")
    lines += ["", f"Verdict: {'all exact' if result['ok'] else 'FAILED'}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true",
                        help="copy vLLM's kernel sources into --kernels (needs .venv-vllm)")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: Triton's interpreter, tiny shapes (its timing only shows "
                             "how many tiles each mode visits)")
    parser.add_argument("--kernels", type=Path, default=Path("build/triton_kernels"))
    parser.add_argument("--out", type=Path, default=Path("out/gpu_check"))
    parser.add_argument("--sessions", default="8,64,256")
    parser.add_argument("--tokens", default="1024,4096,32768")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    def log(text: str) -> None:
        print(text, flush=True)

    from metronome.vllm import triton_sources

    if args.prepare:
        folder = triton_sources.prepare(args.kernels)
        log(f"prepared {folder} from {json.loads((folder / 'SOURCE.json').read_text())}")
        return 0
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
        warnings.filterwarnings("ignore", message=".*flex_attention called without "
                                "torch.compile.*")  # eager is the point on CPU
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
        if not (args.kernels / triton_sources.FILES[0]).exists():
            triton_sources.prepare(args.kernels)
    import torch
    import triton

    unified_attention = triton_sources.load(args.kernels)
    if args.dry_run:
        device, shapes, tolerance = torch.device("cpu"), DRY_SHAPES, 1e-4
    else:
        if not torch.cuda.is_available():
            log("no CUDA device here: run with --dry-run on CPU")
            return 2
        device, shapes, tolerance = torch.device("cuda"), GPU_SHAPES, 2e-2  # bf16 inputs
    torch.manual_seed(0)
    runner = TritonRunner(torch, unified_attention, shapes, 4096, device)
    log(f"correctness ({'dry run, CPU interpreter' if args.dry_run else device}):")
    correctness = check_correctness(torch, runner, shapes, device, tolerance, log)
    sessions = [int(x) for x in args.sessions.split(",")]
    lengths = [int(x) for x in args.tokens.split(",")]
    repeats = args.repeats
    if args.dry_run:  # the interpreter's time grows with the tiles a call visits: a proxy
        span = shapes.sink_tokens + shapes.window_tokens  # (the fastest of 5: a busy CPU
        sessions, lengths, repeats = [2], [4 * span, 16 * span], 5  # only adds time)
    proxy = ", interpreter: time ~ tiles visited" if args.dry_run else ""
    log(f"timing (decode, one layer{proxy}):")
    timing = time_grid(torch, runner, shapes, device, sessions, lengths, repeats, log)
    machine = (torch.cuda.get_device_name() if device.type == "cuda"
               else f"{cpu_name()}, {os.cpu_count()} CPUs (Triton's interpreter)")
    result = {"mode": "dry run (CPU)" if args.dry_run else "GPU",
              "command": "python scripts/gpu_check.py " + " ".join(argv or sys.argv[1:]),
              "commit": git_commit(), "machine": machine, "torch": torch.__version__,
              "triton": triton.__version__,
              "kernel_source": json.loads((args.kernels / "SOURCE.json").read_text())
              if (args.kernels / "SOURCE.json").exists() else {},
              "shapes": asdict(shapes), "correctness": correctness, "timing": timing,
              "ok": all(row["ok"] for row in correctness)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (args.out / "gpu_check.md").write_text(report(result))
    log(f"wrote {args.out / 'gpu_check.json'} and gpu_check.md: "
        f"{'all exact' if result['ok'] else 'FAILED'}")
    return 0 if result["ok"] else 1
