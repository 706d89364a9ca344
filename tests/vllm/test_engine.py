"""The plugin in a real vLLM engine (front-end, engine-core and worker processes) on SmolLM2.

One bounded engine (S = 4, W = 128, a 1,024-token KV pool, max_model_len 8,192) and one
stock engine, each started once (~40 s) and shut down before the next. The long session
is a 3,000-token Hamlet prompt + 2,000 greedy tokens: 5,000 tokens in a pool of 1,024.

Reference: our own engine with the same rule, teacher-forced over the plugin's tokens
(`tests.vllm.bound_reference`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                    reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

import torch  # noqa: E402

from metronome.corpus import play_text  # noqa: E402
from metronome.model.weights import bundled_model_dir, load_tokenizer  # noqa: E402
from tests.vllm.bound_reference import reference  # noqa: E402

pytestmark = pytest.mark.model

BOUND = "sinks_window:4:128"
BLOCK = 32
PROMPT_TOKENS, NEW_TOKENS = 3000, 2000
POOL_BYTES = 45 << 20  # 32 blocks of 32 tokens at 46,080 B/token (SmolLM2 fp32): 1,024 tokens
SHORT_PROMPT, SHORT_NEW = 40, 80  # 120 tokens: inside S + W, the bound changes nothing
AGAIN_NEW = 64  # the long prompt once more: its sink block from the prefix cache


@dataclass(frozen=True)
class Run:
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token
    finish_reason: str
    num_cached_tokens: int  # prompt tokens served from the prefix cache


def start_engine(bounded: bool):
    from vllm import LLM

    # 2-core machine: let the worker use both cores (vLLM reserves one by default)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    extra = (dict(hf_overrides={"metronome_residency": BOUND}, max_model_len=8192,
                  kv_cache_memory_bytes=POOL_BYTES) if bounded else
             dict(max_model_len=4096, kv_cache_memory_bytes=4 * POOL_BYTES + (8 << 20)))
    # prefix caching stays on (vLLM's default): the short session hits the long one's blocks
    return LLM(model=str(bundled_model_dir()), dtype="float32", block_size=BLOCK,
               max_num_seqs=2, max_num_batched_tokens=256, enforce_eager=True, seed=0, **extra)


def greedy(llm, prompt_ids: list[int], new_tokens: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)
    completion = out[0].outputs[0]
    logprobs = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids,
                                                    strict=True)]
    return Run(list(completion.token_ids), logprobs, completion.finish_reason,
               out[0].num_cached_tokens)


@pytest.fixture(scope="module")
def prompts():
    ids = load_tokenizer().encode(play_text("hamlet")).ids
    return {"long": ids[:PROMPT_TOKENS], "short": ids[:SHORT_PROMPT]}


@pytest.fixture(scope="module")
def bounded(prompts):
    llm = start_engine(bounded=True)
    pool_tokens = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks * BLOCK
    runs = {"long": greedy(llm, prompts["long"], NEW_TOKENS),
            "short": greedy(llm, prompts["short"], SHORT_NEW),
            "again": greedy(llm, prompts["long"], AGAIN_NEW)}
    llm.llm_engine.engine_core.shutdown()
    return pool_tokens, runs


@pytest.fixture(scope="module")
def stock(prompts):
    llm = start_engine(bounded=False)
    runs = {"long": greedy(llm, prompts["long"], 4), "short": greedy(llm, prompts["short"],
                                                                     SHORT_NEW)}
    llm.llm_engine.engine_core.shutdown()
    return runs


def test_session_five_times_the_pool_runs_to_the_end(bounded):
    pool_tokens, runs = bounded
    assert pool_tokens == 1024
    assert PROMPT_TOKENS + len(runs["long"].token_ids) == 5000 > pool_tokens
    assert runs["long"].finish_reason == "length"


def test_long_session_is_token_exact_against_the_reference(bounded, prompts):
    tokens, logprobs = bounded[1]["long"].token_ids, bounded[1]["long"].logprobs
    greedy_ids, chosen = reference(prompts["long"] + tokens, BOUND)
    assert greedy_ids[PROMPT_TOKENS - 1:] == tokens
    assert (chosen[PROMPT_TOKENS - 1:] - torch.tensor(logprobs)).abs().max() < 1e-3


def test_the_bound_matters_stock_attends_everything(bounded, stock):
    assert abs(bounded[1]["long"].logprobs[0] - stock["long"].logprobs[0]) > 1e-2


def test_window_covering_the_session_equals_stock(bounded, stock):
    ours, theirs = bounded[1]["short"], stock["short"]
    assert SHORT_PROMPT + SHORT_NEW <= 128  # W >= session length
    assert ours.num_cached_tokens == BLOCK  # the long session's sink block, from the cache
    assert ours.token_ids == theirs.token_ids
    # fp32 noise only: the cached block's K/V came from a 256-token chunk that the bounded
    # engine ran through its gather path, stock through its kernel (measured 1.5e-5)
    assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs, strict=True)) < 1e-4


def test_a_shared_prefix_stays_exact(bounded):
    """Prefix caching on: the long prompt again reuses cached blocks (at least the sink
    block; the gap was freed and its blocks reused) and, past S + W on the in-place path
    that reads those shared blocks, gives the first run's tokens."""
    first, again = bounded[1]["long"], bounded[1]["again"]
    assert again.num_cached_tokens >= BLOCK
    assert again.token_ids == first.token_ids[:AGAIN_NEW]
    assert max(abs(a - b) for a, b in zip(again.logprobs, first.logprobs, strict=False)) < 1e-4
