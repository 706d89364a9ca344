"""The bound on vLLM's GPU attention backends, checked on CPU: the backend gate, the window
in the model config, the prefix S in every wrapped metadata build (Triton's with a
compacted table), vLLM's own FlexAttention metadata builder against our rule, and vLLM's
own Triton kernel under Triton's interpreter (`scripts/gpu_check.py --dry-run`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.v1.kv_cache_spec_registry",
                    reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")

import torch  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from metronome.kv.residency import ResidencyPolicy  # noqa: E402
from metronome.vllm import gpu_metadata  # noqa: E402
from metronome.vllm.backends import (  # noqa: E402
    UnsupportedBackend,
    check_backend,
    check_layer_features,
    check_parallelism,
    check_window_config,
)
from metronome.vllm.config import SinksWindow  # noqa: E402
from metronome.vllm.engine import VllmEngineConfig  # noqa: E402
from metronome.vllm.plugin import bounded_spec  # noqa: E402
from metronome.vllm.spec import SinksWindowSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
S, W, BS, KV, H, D = 4, 32, 16, 2, 4, 16
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=KV, head_size=D, dtype=torch.float32)
SPEC = SinksWindowSpec.from_full_attention(FULL, S, W, 64)


# ---- the gate ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend,version", [("TRITON_ATTN", None), ("FLEX_ATTENTION", None),
                                             ("FLASH_ATTN", 4)])
def test_gpu_backends_that_apply_the_prefix_pass(backend, version):
    check_backend(backend, on_cpu=False, flash_attn_version=version)
    spec = bounded_spec(FULL, SinksWindow(S, W), backend, "layers.0.attn", 64, False, version)
    assert isinstance(spec, SinksWindowSpec)


@pytest.mark.parametrize("backend,version,why", [
    ("FLASH_ATTN", 3, "FlashAttention FA3 .*ignores R-SWA's prefix"),
    ("FLASH_ATTN", 2, "FlashAttention FA2"),
    ("FLASH_ATTN", None, "FA2/FA3"),
    ("FLASHINFER", None, "FlashInfer takes a plain sliding window"),
    ("TREE_ATTN", None, "does not apply R-SWA's per-request prefix"),
])
def test_gpu_backends_that_would_attend_the_gap_are_refused_with_the_fix(backend, version, why):
    with pytest.raises(UnsupportedBackend, match=why) as refused:
        bounded_spec(FULL, SinksWindow(S, W), backend, "layers.0.attn", 64, False, version)
    assert "TRITON_ATTN" in str(refused.value) and "metronome_residency" in str(refused.value)


def test_on_cpu_only_the_cpu_backend_passes():
    check_backend("CPU_ATTN", on_cpu=True)
    with pytest.raises(UnsupportedBackend, match="not supported on CPU"):
        check_backend("TRITON_ATTN", on_cpu=True)


def test_layer_features_no_backend_bounds_are_refused():
    plain = SimpleNamespace(alibi_slopes=None, logits_soft_cap=None, sinks=None,
                            kv_cache_dtype="auto")
    check_layer_features(plain, "layers.0.attn")
    for change, name in [({"alibi_slopes": torch.ones(4)}, "ALiBi"),
                         ({"logits_soft_cap": 30.0}, "soft-capping"),
                         ({"sinks": torch.zeros(4)}, "learned attention sinks"),
                         ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype=fp8")]:
        with pytest.raises(UnsupportedBackend, match=name):
            check_layer_features(SimpleNamespace(**(vars(plain) | change)), "layers.0.attn")
    check_layer_features(SimpleNamespace(**(vars(plain) | {"kv_cache_dtype": "bfloat16"})),
                         "layers.0.attn")  # unquantized, explicit: the GPU kernels take it


def test_context_parallelism_is_refused():
    check_parallelism(1, 1)
    for dcp, pcp in ((2, 1), (1, 2)):
        with pytest.raises(UnsupportedBackend, match="context parallelism"):
            check_parallelism(dcp, pcp)


def test_the_window_reaches_the_backends_through_rswa_window():
    check_window_config(W, W, on_cpu=False)
    check_window_config(None, W, on_cpu=True)
    with pytest.raises(UnsupportedBackend, match=f'"rswa_window": {W} to hf_overrides'):
        check_window_config(None, W, on_cpu=False)
    with pytest.raises(UnsupportedBackend, match="not W"):
        check_window_config(W + 1, W, on_cpu=False)
    with pytest.raises(UnsupportedBackend, match="no R-SWA"):
        check_window_config(W, W, on_cpu=True)


def test_vllm_engine_sets_window_and_triton_on_gpus_only():
    config = VllmEngineConfig("model", policy=ResidencyPolicy.parse("sinks_window:4:512"))
    gpu = config.engine_args(1024, on_cpu=False)
    assert gpu["hf_overrides"]["rswa_window"] == 512
    assert gpu["hf_overrides"]["metronome_residency"].startswith("sinks_window:4:512")
    assert gpu["attention_backend"] == "TRITON_ATTN"
    cpu = config.engine_args(1024, on_cpu=True)
    assert "rswa_window" not in cpu["hf_overrides"] and "attention_backend" not in cpu
    stock = VllmEngineConfig("model").engine_args(1024, on_cpu=False)
    assert "hf_overrides" not in stock and "attention_backend" not in stock


def test_vllm_engine_modes():
    """default: vLLM's own (compiled; vLLM decides async scheduling on CPU, where it turns
    it off; on GPUs the adapter asks for synchronous steps: it reads each step's outputs in
    that step); eager: enforce_eager, synchronous; anything else refused by name."""
    bound = ResidencyPolicy.parse("sinks_window:4:512")
    default = VllmEngineConfig("model", policy=bound)
    assert default.mode == "default"
    cpu = default.engine_args(1024, on_cpu=True)
    assert "enforce_eager" not in cpu and "async_scheduling" not in cpu
    gpu = default.engine_args(1024, on_cpu=False)
    assert "enforce_eager" not in gpu and gpu["async_scheduling"] is False
    eager = VllmEngineConfig("model", policy=bound, mode="eager")
    for on_cpu in (True, False):
        args = eager.engine_args(1024, on_cpu=on_cpu)
        assert args["enforce_eager"] is True and args["async_scheduling"] is False
    with pytest.raises(ValueError, match="vLLM mode 'compiled': one of default, eager"):
        VllmEngineConfig("model", mode="compiled")


# ---- the wrapped builds --------------------------------------------------------------------
def common_metadata(requests, table, prompt_lens):
    starts = [0]
    for _, q in requests:
        starts.append(starts[-1] + q)
    qsl = torch.tensor(starts, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor([n for n, _ in requests], dtype=torch.int32),
        num_reqs=len(requests), num_actual_tokens=starts[-1],
        max_query_len=max(q for _, q in requests), max_seq_len=max(n for n, _ in requests),
        block_table_tensor=table, slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        rswa_prefix_lens=torch.tensor(prompt_lens, dtype=torch.int32))


def fake_vllm_config(num_blocks):
    model = SimpleNamespace(get_num_attention_heads=lambda _: H, get_num_kv_heads=lambda _: KV,
                            get_head_size=lambda: D, max_model_len=4096, rswa_window=W)
    return SimpleNamespace(
        model_config=model, parallel_config=None,
        cache_config=SimpleNamespace(num_gpu_blocks=num_blocks),
        attention_config=SimpleNamespace(flex_attn_q_block_size=None, flex_attn_block_m=None,
                                         flex_attn_kv_block_size=None, flex_attn_block_n=None),
        scheduler_config=SimpleNamespace(max_num_seqs=8, max_num_batched_tokens=256),
        compilation_config=SimpleNamespace(cudagraph_mode=None))


class RecordingBuilder:
    """A stand-in builder: its stock `build` records what it was given."""

    def __init__(self, spec, rswa_window=W):
        self.kv_cache_spec, self.vllm_config, self.seen = spec, fake_vllm_config(64), []
        self.rswa_window = rswa_window  # what vLLM's builders read from the model config

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self.seen.append((common_prefix_len, common_attn_metadata))
        return "built"


def test_bounded_builds_carry_prefix_s_and_others_are_untouched():
    class Triton(RecordingBuilder):
        pass

    gpu_metadata.wrap_builder(Triton, compact=True)
    gpu_metadata.wrap_builder(Triton, compact=True)  # idempotent: register() runs again
    requests = [(300, 1), (40, 16)]
    table = torch.arange(1, 1 + 2 * 20, dtype=torch.int32).view(2, 20)
    stock = common_metadata(requests, table, [300, 40])  # stock R-SWA: the prompt lengths
    bounded = Triton(SPEC)
    assert bounded.build(7, stock) == "built"
    prefix_len, seen = bounded.seen[0]
    assert prefix_len == 0  # no cascade across the gap
    assert seen.rswa_prefix_lens.tolist() == [S, S]
    assert seen.seq_lens.tolist() == [300 - 15 * BS, 40]  # window from 268: block 16 -> 1
    assert seen.block_table_tensor[0, 0] == table[0, 0] and seen.max_seq_len < 300
    assert stock.rswa_prefix_lens.tolist() == [300, 40]  # the runner's metadata is not mutated
    plain = Triton(FULL, rswa_window=None)
    plain.build(7, stock)
    assert plain.seen[0] == (7, stock)  # a layer without the bound: stock, same object
    with pytest.raises(UnsupportedBackend, match="rswa_window=None, not W"):
        Triton(SPEC, rswa_window=None).build(0, stock)  # would drop the prefix: refused


# ---- vLLM's FlexAttention metadata builder, on CPU -----------------------------------------
def test_flex_metadata_with_prefix_s_is_our_rule_and_skips_the_gap():
    from torch.nn.attention.flex_attention import flex_attention
    from vllm.v1.attention.backends.flex_attention import FlexAttentionMetadataBuilder

    from tests.vllm.attention_reference import dense_reference

    requests = [(200, 1), (57, 16), (30, 1), (130, 16)]
    num_blocks, width = 64, 16
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, BS, KV, D, generator=generator)
    v_cache = torch.randn(num_blocks, BS, KV, D, generator=generator)
    k_cache[0] = v_cache[0] = 1e3  # the null block: garbage, never to be attended
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    live, next_block = [], 1
    for r, (n, q) in enumerate(requests):
        reach = max(0, n - q - W + 1) // BS
        blocks = [b for b in range(-(-n // BS)) if b < -(-S // BS) or b >= reach]
        for b in blocks:
            table[r, b] = next_block
            next_block += 1
        live.append(blocks)
    gpu_metadata.install()
    builder = FlexAttentionMetadataBuilder(SPEC, ["layers.0.attn"], fake_vllm_config(num_blocks),
                                           torch.device("cpu"))
    md = builder.build(0, common_metadata(requests, table, [n for n, _ in requests]))
    assert md.rswa_prefix_lens[: len(requests)].tolist() == [S] * len(requests)
    # the direct block mask lists, per query token, exactly its sink and window pages
    token = 0
    for r, (n, q) in enumerate(requests):
        for i in range(q):
            p = n - q + i
            pages = {int(table[r, b]) for b in range(-(-(p + 1) // BS))
                     if b < -(-S // BS) or (b + 1) * BS > p - W + 1}
            indices = md.block_mask.kv_indices[0, 0, token]
            got = set(indices[: md.block_mask.kv_num_blocks[0, 0, token]].tolist())
            assert got == pages, (r, i)  # no gap page, no null block
            token += 1
    # its mask_mod is our rule wherever a key lives
    q_idx = torch.arange(md.num_actual_tokens)[:, None]
    kv_idx = torch.arange(num_blocks * BS)[None, :]
    mask = md.mask_mod(torch.zeros(()), torch.zeros(()), q_idx, kv_idx)
    token = 0
    for r, (n, q) in enumerate(requests):
        for i in range(q):
            p = n - q + i
            rule = {int(table[r, j // BS]) * BS + j % BS for j in range(p + 1)
                    if j < S or p - j < W}
            assert set(torch.nonzero(mask[token]).flatten().tolist()) == rule
            token += 1
    query = torch.randn(md.num_actual_tokens, H, D, generator=generator)
    as_4d = lambda x: x.reshape(-1, x.shape[-2], D).unsqueeze(0).permute(0, 2, 1, 3)  # noqa: E731
    out = flex_attention(as_4d(query), as_4d(k_cache), as_4d(v_cache), block_mask=md.block_mask,
                         scale=D ** -0.5, enable_gqa=True)[0].permute(1, 0, 2)
    keys = [k_cache[table[r, torch.arange(n) // BS].long(), torch.arange(n) % BS]
            for r, (n, _) in enumerate(requests)]
    values = [v_cache[table[r, torch.arange(n) // BS].long(), torch.arange(n) % BS]
              for r, (n, _) in enumerate(requests)]
    expected = dense_reference(keys, values, query, [n for n, _ in requests],
                               [q for _, q in requests], SinksWindow(S, W), D ** -0.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


# ---- vLLM's Triton kernel, in Triton's interpreter ---------------------------------------------
def test_vllm_triton_kernel_with_prefix_s_and_compaction_is_exact(tmp_path):
    """The GPU check's dry run: vLLM's own kernel on CPU, R-SWA at prefix S over the full
    table, and over the compacted table with NaN gap blocks, and eager flex_attention with
    our paged block mask, all against fp32 dense; the compacted call's bound on what it
    iterates is the same at both L, and its timing proxy (interpreter time grows with the
    tiles visited) shows the full table costing more, and more with L."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run",
                           "--kernels", str(tmp_path / "kernels"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    modes = {(row["case"], row["mode"]) for row in result["correctness"] if row["ok"]}
    assert len(modes) == 12 and result["ok"]  # 4 cases x (rswa, compact, flex)
    assert "| chunk64 | compact | nan |" in (tmp_path / "gpu_check.md").read_text()
    short, long = result["timing"]  # L = 4 (S + W) and 16 (S + W)
    # What the compacted call iterates is bounded whatever L (exact), and the interpreter's
    # time, a noisy proxy of the tiles visited, agrees where its margin is wide: at 16 (S + W)
    # the full table costs 3-5x the compacted one (measured 3.1-5.2x), and it grows with L
    # (1.5-2.3x). A tighter timing bound failed CI twice (a 1.49x growth; a compacted long
    # cell at 1.78x its short one, the fastest of 5), so none is asserted.
    from metronome.vllm.compaction import max_compacted_len
    from metronome.vllm.gpu_check import DRY_SHAPES as sh

    bounds = {max_compacted_len(row["tokens"], 1, sh.sink_tokens, sh.window_tokens,
                                sh.block_size) for row in (short, long)}
    assert len(bounds) == 1 and bounds.pop() < short["tokens"] < long["tokens"]
    assert long["compact_ms"] < long["rswa_ms"] / 2
    assert long["rswa_ms"] > short["rswa_ms"]


def test_our_flex_block_mask_lists_only_sink_and_window_pages():
    from metronome.vllm.flex_mask import paged_block_mask

    requests = [(200, 1), (57, 16), (3, 1), (130, 16)]
    table = torch.arange(1, 1 + 4 * 16, dtype=torch.int32).view(4, 16)
    common = common_metadata(requests, table, [0] * 4)
    mask = paged_block_mask(table, common.seq_lens, common.query_start_loc, S, W, BS, 80)
    token = 0
    for r, (n, q) in enumerate(requests):
        for i in range(q):
            p = n - q + i
            pages = {int(table[r, b]) for b in range(p // BS + 1)
                     if b < -(-S // BS) or (b + 1) * BS > p - W + 1}
            count = int(mask.kv_num_blocks[0, 0, token])
            assert set(mask.kv_indices[0, 0, token, :count].tolist()) == pages, (r, i)
            assert count == len(pages)  # each page once
            token += 1


def test_the_stock_prompt_prefix_would_not_be_our_rule(tmp_path):
    """Control: with stock R-SWA's prefix (the whole history, a streaming session's prompt)
    the same kernel is no longer the bound, so the check above can fail."""
    program = f"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {str(ROOT / 'src')!r})
import torch
from metronome.vllm import gpu_check, triton_sources
folder = triton_sources.prepare(__import__("pathlib").Path({str(tmp_path)!r}))
shapes = gpu_check.DRY_SHAPES
runner = gpu_check.TritonRunner(torch, triton_sources.load(folder), shapes, 64, torch.device("cpu"))
batch = gpu_check.Batch(torch, shapes, gpu_check.correctness_cases(shapes)["decode"],
                        torch.device("cpu"), 1e3, torch.Generator().manual_seed(0))
runner.prefix_lens[: len(batch.requests)] = batch.seq_lens
error = (runner(batch, "rswa") - gpu_check.reference(torch, batch)).abs().max().item()
print(error)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) > 1e-2


def test_vllm_triton_builder_gets_prefix_s_and_the_compacted_table():
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

    gpu_metadata.install()
    config = fake_vllm_config(64)
    config.compilation_config.static_forward_context = {}
    builder = TritonAttentionMetadataBuilder(SPEC, ["layers.0.attn"], config, torch.device("cpu"))
    requests = [(300, 1), (40, 16), (120, 16)]
    table = torch.arange(1, 1 + 3 * 20, dtype=torch.int32).view(3, 20)
    common = common_metadata(requests, table, [n for n, _ in requests])
    md = builder.build(0, common)
    assert md.rswa_window == W and md.rswa_prefix_lens.tolist() == [S, S, S]
    assert md.rswa_prefix_lens.data_ptr() == builder.persistent_rswa_prefix_lens.data_ptr()
    # request 0: window from 268 -> blocks 16.. move behind the sink block; 2: from 73 -> 4..
    assert md.seq_lens.tolist() == [300 - 15 * BS, 40, 120 - 3 * BS]
    assert md.block_table[0, :5].tolist() == [1, 17, 18, 19, 20]
    assert md.block_table[2, :5].tolist() == [41, 45, 46, 47, 48]
    assert md.max_seq_len >= max(md.seq_lens.tolist())
    again = builder.build(0, common)  # the same persistent buffers every step (CUDA graphs)
    assert again.block_table.data_ptr() == md.block_table.data_ptr()
    assert again.seq_lens.data_ptr() == md.seq_lens.data_ptr()
