"""The workload and sizing defaults every entry point shares: `metronome serve` (its
`ServerConfig`), `metronome run` / `plan` / `demo`, the runtime's `SessionProfile`, the engine,
the planner, the virtual-clock scenarios and the experiments. Each value is declared here only;
where one entry point deliberately differs, the difference is its own named constant below,
with the reason.

Plain constants, no imports: anything may read them without pulling in a layer.
"""

from __future__ import annotations

# ---- a session's timing -------------------------------------------------------------------
# 1 s frames: the Qwen-Omni / MiniCPM-o chunk size (0.08 s is Moshi's).
FRAME_PERIOD_S = 1.0
DEADLINE_FRACTION = 1.0  # deadline = fraction x frame period after the frame arrives

# ---- what a frame carries -----------------------------------------------------------------
INPUT_TOKENS_PER_FRAME = 12  # text input of one frame (about 1 s of speech's tokens)
OUTPUT_TOKENS_PER_FRAME = 4  # duplex: tokens generated after each frame

# ---- KV -----------------------------------------------------------------------------------
BLOCK_SIZE_TOKENS = 16
POOL_TOKENS = 65536  # the KV pool when nothing else is said: 4,096 blocks of 16
POLICY_SPEC = "sinks_window:4:512"  # every session's bound in serve, run and plan

# The experiments and the virtual-clock benches (admission, plan, runtime) bound sessions to
# a 128-token window: their sessions live 30-60 s at 16 KV tokens/s, so a 4+128 bound slides
# early in each run and its steady state fills most of the run (4+512 would not slide in the
# shortest ones).
EXPERIMENT_POLICY_SPEC = "sinks_window:4:128"

# `metronome demo` streams 6 short turns (a ~15-token line, a 12-token reply): a 64-token
# window slides within the first few, so the demo shows the bound plateau in seconds; its
# small pool keeps the displayed block counts readable.
DEMO_POLICY_SPEC = "sinks_window:4:64"
DEMO_POOL_TOKENS = 16384

# ---- admission ----------------------------------------------------------------------------
TARGET_FRACTION = 0.8  # AIMD's target: p95 latency <= 0.8 x deadline
