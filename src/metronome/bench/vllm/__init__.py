"""What the vLLM benches (`metronome bench vllm`, `metronome bench engine-vs-vllm`) measure
with, kept apart from their reports:

    engines   the systems: stock vLLM, its sliding window, vLLM + the Metronome bound, the
              native engine; the real text both prefill
    decode    decode step cells of one engine (bench vllm)
    stream    the streaming workload on stock vLLM and on Metronome on vLLM, each arm's
              frames summarized by one rule
    pair      one native engine and one vLLM engine alive together, prefilled and decoding
              in alternating rounds, and our GEMMs against torch's peak (engine-vs-vllm)

Everything here needs vLLM (`make vllm-install`; run from .venv-vllm).
"""
