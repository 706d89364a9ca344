"""A/B two builds of the paged-attention kernel on a decode step's attention, side by side.

Each of two source folders (copies of `src/metronome/model/csrc` with one edit between them)
is built as its own extension; both then attend the same queries over the same K/V: the
bundled model's shape (9 query heads, 3 KV heads, head size 64) for `--layers` layers,
`--sessions` bounded sessions (sinks 4 + window 512 at position 1,100: 18 blocks of 32
each), their blocks spread at random over a pool of 600 blocks per layer (more where the
sessions need more; `--order random`, as a pool in use holds them) or in a row
(`contiguous`). Rounds alternate which build goes
first; unless `--hot`, a 64 MiB buffer is written before each run, so K/V come from memory
(a step's case: 30 layers of 8 sessions' windows is ~190 MB in float32, past any L3).
`--shared` gives every layer the first layer's K/V (with few sessions, an in-cache run: the
kernel's compute alone). `--unbounded-tokens L`: unbounded sessions of L tokens instead (e.g.
`--sessions 32 --layers 8 --unbounded-tokens 4096`, a long-context decode). Prints whether
the outputs are bit-identical, and each build's median and fastest time over the rounds.

    cp -r src/metronome/model/csrc /tmp/ab/a; cp -r src/metronome/model/csrc /tmp/ab/b
    # ... edit /tmp/ab/b ...
    flock /tmp/cpu.lock .venv/bin/python scripts/attention_ab.py /tmp/ab/a /tmp/ab/b

Builds go to `<folder>_build` beside each folder (~1 min each the first time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from metronome.model.native import CFLAGS  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 9, 3, 64, 32
SINKS, WINDOW, POSITION = 4, 512, 1100
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(folder: Path):
    import torch.utils.cpp_extension as cpp

    out = folder.parent / f"{folder.name}_build"
    out.mkdir(exist_ok=True)
    print(f"building {folder} ...", file=sys.stderr, flush=True)
    return cpp.load(name=f"attention_ab_{folder.name}",
                    sources=[str(folder / "paged_attention.cpp")], extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(out), verbose=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="folder of build A's csrc")
    parser.add_argument("b", type=Path, help="folder of build B's csrc")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--order", choices=("random", "contiguous"), default="random")
    parser.add_argument("--hot", action="store_true", help="no cache flush between runs")
    parser.add_argument("--shared", action="store_true", help="every layer reads layer 0's K/V")
    parser.add_argument("--unbounded-tokens", type=int, default=None, metavar="L",
                        help="unbounded sessions of L tokens each (the query at L - 1) "
                             "instead of the sinks + window at 1,100")
    args = parser.parse_args()
    if args.a.resolve() == args.b.resolve():
        parser.error("A and B must be different folders")
    for folder in (args.a, args.b):
        if not (folder / "paged_attention.cpp").is_file():
            parser.error(f"{folder} holds no paged_attention.cpp")
    builds = [build(args.a), build(args.b)]
    dtype, sessions = DTYPES[args.dtype], args.sessions
    torch.manual_seed(0)
    if args.unbounded_tokens is not None:
        if args.unbounded_tokens < 1:
            parser.error("--unbounded-tokens must be at least 1")
        sinks, position, window_start = 0, args.unbounded_tokens - 1, 0
        logical = list(range(position // BLOCK_TOKENS + 1))
    else:
        sinks, position, window_start = SINKS, POSITION, POSITION - WINDOW + 1
        logical = [0] + list(range(window_start // BLOCK_TOKENS, POSITION // BLOCK_TOKENS + 1))
    blocks = len(logical)
    pool_blocks = max(600, sessions * blocks)  # the sessions' blocks spread over the pool
    layers = []
    for _ in range(1 if args.shared else args.layers):
        shape = (KV_HEADS, pool_blocks * BLOCK_TOKENS, HEAD_DIM)
        k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
        order = (torch.randperm(pool_blocks) if args.order == "random"
                 else torch.arange(pool_blocks))
        layers.append((k, v, order[: sessions * blocks].view(sessions, blocks).contiguous()))
    layers = layers * args.layers if args.shared else layers

    def per_session(value: int) -> torch.Tensor:
        return torch.full((sessions,), value, dtype=torch.long)

    tail = (torch.arange(sessions), per_session(position), per_session(window_start))
    tables = (torch.tensor([logical] * sessions), per_session(blocks), per_session(sinks),
              per_session(1 if sinks else 0))
    q = torch.randn(sessions, HEADS, HEAD_DIM).to(dtype)
    flush = torch.empty(64 * 1024 * 1024 // 4)

    def run(module) -> list[torch.Tensor]:
        return [module.paged_attention(q, None, k, v, *tail, ids, *tables, BLOCK_TOKENS,
                                       HEAD_DIM**-0.5) for k, v, ids in layers]

    same = all(torch.equal(x, y) for x, y in zip(run(builds[0]), run(builds[1]), strict=True))
    print(f"outputs bit-identical: {same}")
    times: list[list[float]] = [[], []]
    for r in range(args.rounds):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            if not args.hot:
                flush.add_(1.0)
            start = time.perf_counter()
            run(builds[i])
            times[i].append((time.perf_counter() - start) * 1e3)
    a, b = (statistics.median(t) for t in times)
    print(f"A {args.a}: median {a:.2f} ms (fastest {min(times[0]):.2f}); "
          f"B {args.b}: median {b:.2f} ms (fastest {min(times[1]):.2f}); B/A {b / a:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
