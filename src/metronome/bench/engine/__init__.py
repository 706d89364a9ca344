"""Engine step benchmark (`metronome bench engine`): one batched decode step, ours (unbounded,
sinks+window) vs transformers, and the step cost calibration fitted from it.
`metronome.bench.engine_bench` is the entry point.

What one measurement is: N sessions, each already L tokens long, each feed one token and
sample one (greedy) in a single batched step. We report step latency (min / median over
`repeats` timed steps after warm-up), tokens/s (N / median step) and resident KV per session.
The same step through Hugging Face transformers, as a user writes it (batched `forward` on a
`DynamicCache`, argmax fed back), is timed in the same run and reported as a ratio.

Side by side: these machines are shared, so numbers that are compared with each other are
measured together. The configurations of a comparison (ours vs transformers at one N and L;
the bounded policy at every L; fp32 vs bf16) are set up at once and their steps interleaved
round-robin, so a burst of load elsewhere hits all of them alike. A group whose KV would
exceed the memory budget together is split into parts that fit (recorded per row).

Session history is synthetic: `Engine.fast_forward` lengthens sessions without running the
model (blocks allocated and slid exactly as for real tokens) and the pool holds random normal
K/V; the transformers cache is filled with random K/V of the same shape. Prefilling 64 x 8k
tokens would take hours on a small CPU, and K/V values do not change the step's cost.

Also measured: the share of step time outside model math (profiler, and a phase split of the
engine step) and achieved FLOP/s against a plain `torch.matmul` over the same linear shapes.

Modules, in the order a run uses them:

    plan          what one run measures (`Config`: the grid or the CI smoke size), keys
    wait_policy   the OpenMP wait policy: set for the measuring process, and probed
    timing        timed calls, interleaved round-robin, and their statistics
    ours          our engine with N synthetic sessions of L tokens
    hf            the same step through Hugging Face transformers
    profiling     where one step goes: torch.profiler split and our engine's phases
    flops         step FLOPs and the plain-matmul reference (the linears: linear_weights)
    measure       configurations side by side within the memory budget; the run's groups
    probe         the wait-policy probe, one child process per policy
    facts         what the run ran on: model, dtype, engine path as it ran
    summary       measured rows -> ratios, flatness, overhead, goals, limits
    report        the summary as markdown
    step_cost     the virtual clock's step cost model fitted from the measured rows, and
                  its calibration (machine, dtype, engine path, commit, command, date)
"""
