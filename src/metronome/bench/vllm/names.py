"""The names of the systems the vLLM benches compare, and their labels in reports (no
measuring code: reports import this, never the engines)."""

from __future__ import annotations

STOCK, SLIDING, PLUGIN, NATIVE = "vllm", "vllm_sliding_window", "vllm_metronome", "native"
OURS = "metronome"  # the native engine in engine-vs-vllm's pairs
LABELS = {STOCK: "stock vLLM", SLIDING: "vLLM sliding window", PLUGIN: "vLLM + Metronome",
          NATIVE: "native Metronome"}
# the streaming workload's arms: vLLM's scheduler alone (full attention, its own sliding
# window), Metronome on vLLM (the beat) unbounded and with the bound, and the native engine
# under the beat with the bound (its default configuration)
STREAM_ARMS = ("stock", "sliding_window", "unbounded", "bounded", "native")
