"""Metronome's KV bound inside vLLM: S pinned sink tokens + a sliding window of W tokens.

A vLLM plugin (entry point `vllm.general_plugins` -> `metronome.vllm.plugin:register`,
installed with `pip install -e '.[vllm]'`, see the Makefile's `vllm-install`). Importing
this package needs no vLLM; its modules do.

Selecting the bound (one engine, one bound; read from the model config in every process):

    from vllm import LLM
    llm = LLM(model_dir, hf_overrides={"metronome_residency": "sinks_window:4:512"})

    vllm serve MODEL --hf-overrides '{"metronome_residency": "sinks_window:4:512"}'

Semantics: a query at absolute position p sees key j iff j <= p and (j < S or p - j < W)
(token-exact, vLLM's sliding-window convention; `metronome.kv.residency` is block-aligned,
and the two agree at block size 1). Positions stay absolute: keys are stored rotated at
the position they were written at.

Memory: a request holds ceil(S / block_size) pinned blocks plus the blocks of its window
and of the tokens in flight; gap blocks go back to the pool as the window slides, so the
pool check at startup and admission charge
`ceil(S/bs) + ceil((W - 1 + max_in_flight_tokens) / bs) + 1` blocks per request, not
`max_model_len`. A session may be far longer than the pool; `max_num_batched_tokens`
(the prefill chunk) is what the per-request reservation grows with.

Length: a request still ends at `max_model_len`, which vLLM caps at the model's
`max_position_embeddings` (its RoPE table size; SmolLM2: 8192). To go further, raise both:
`hf_overrides={"metronome_residency": ..., "max_position_embeddings": 32768}` and
`max_model_len=32768`. Positions past the trained range are extrapolated RoPE, which the
model never saw (quality degrades; see docs/results/paper.md). Do not use
`VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` alone: the RoPE table keeps max_position_embeddings rows,
and a position past it makes the native path raise IndexError and the CPU rotary kernel
segfault (measured: position 9000 on an 8192-row table).

Modules: `config` (the bound, from hf_overrides), `spec` (KV cache spec + manager: what is
pinned and freed), `attention` (exact CPU attention: vLLM's kernel inside S + W, past it
`kernel`'s in-place C++ kernel, or the gather fallback), `layout` (where vLLM's CPU cache
writer puts each K/V element), `plugin` (the entry point); on GPUs `backends` (which
attention backends apply the bound), `gpu_metadata` (prefix S in the metadata builds),
`compaction` (Triton's block table cut to sink + window blocks); for the GPU check
`triton_sources`, `flex_mask`, `gpu_check`; `engine` (`VllmEngine`, vLLM behind
Metronome's engine seam) and `profile` (where its steps' time goes).
Attention backends: CPU_ATTN on CPU; TRITON_ATTN, FLEX_ATTENTION and FA4 on GPUs (their
R-SWA mask with the prefix at S); the others are refused with the reason (`backends`).
"""
