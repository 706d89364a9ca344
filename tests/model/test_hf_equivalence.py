"""Our paged forward against Hugging Face transformers on the real bundled SmolLM2 (and on
tiny Qwen2 / Qwen3 models built locally, for the qkv-bias and q/k-norm paths)."""

from __future__ import annotations

import os

import pytest
import torch

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model.weights import bundled_model_dir, load_model
from metronome.stream import Stream
from tests.steps import by_session

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a young shepherd who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is two plus two?\nA:",
]
DECODE_STEPS = 32


def generate_batched(model, prompts_ids, policy, decode_steps=DECODE_STEPS):
    """All sessions in one engine, prefilled and decoded together; logits of every position."""
    engine = Engine(model, EngineConfig(block_size=16, pool_tokens=8192))
    sids = []
    for ids in prompts_ids:
        sid = engine.open_session(Stream.of(SessionSpec(policy=policy, return_logits=True,
                                              stop_token_ids=())))
        engine.submit(sid, ids, max_new_tokens=decode_steps)
        sids.append(sid)
    tokens = {s: [] for s in sids}
    logits = {s: [] for s in sids}
    steps = 0
    while engine.has_work:
        result = engine.step()
        steps += 1
        assert len(result.status) == len(sids) or steps > 1  # prefill is one batched step
        for outcome in by_session(result).values():
            tokens[outcome.session_id] += outcome.new_token_ids
            logits[outcome.session_id].append(outcome.logits)
    return [tokens[s] for s in sids], [torch.cat(logits[s]) for s in sids], steps


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from metronome.model.weights import load_tokenizer

    return load_tokenizer()


def test_smollm2_logits_match_transformers(smollm2, hf_smollm2, tokenizer):
    prompts_ids = [tokenizer.encode(p).ids for p in PROMPTS]
    assert len({len(p) for p in prompts_ids}) == len(PROMPTS)  # different lengths
    tokens, logits, steps = generate_batched(smollm2, prompts_ids, ResidencyPolicy.unbounded())
    assert steps == DECODE_STEPS  # prefill step + 31 feed-back steps, all sessions batched
    for ids, new, ours in zip(prompts_ids, tokens, logits, strict=True):
        assert len(new) == DECODE_STEPS
        full = torch.tensor([ids + new[:-1]])
        with torch.inference_mode():
            ref = hf_smollm2(full).logits[0].float()
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
        # greedy tokens are HF's argmax at every generated position
        assert new == ref[len(ids) - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize("positions", ["absolute", "rolling"])
def test_huge_window_equals_unbounded_greedy(smollm2, tokenizer, positions):
    prompts_ids = [tokenizer.encode(p).ids for p in PROMPTS]
    unbounded, _, _ = generate_batched(smollm2, prompts_ids, ResidencyPolicy.unbounded(), 40)
    bounded, _, _ = generate_batched(
        smollm2, prompts_ids, ResidencyPolicy.sinks_window(4, 4096, positions), 40
    )
    assert bounded == unbounded


def _tiny_hf(arch: str, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms/biases so those code paths matter
        for name, param in hf.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.3)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_hf_directory_families_match_transformers(arch, tmp_path):
    hf = _tiny_hf(arch, tmp_path)
    ours = load_model(str(tmp_path), torch.float32)
    assert ours.config.qkv_bias == (arch == "qwen2")
    assert ours.config.qk_norm == (arch == "qwen3")
    prompts = [[5, 9, 17, 3, 99, 42, 7], [1, 2, 3]]
    tokens, logits, _ = generate_batched(ours, prompts, ResidencyPolicy.unbounded(), 8)
    for ids, new, got in zip(prompts, tokens, logits, strict=True):
        with torch.inference_mode():
            ref = hf(torch.tensor([ids + new[:-1]])).logits[0]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
