"""From-scratch dense references for the engine's attention semantics (tests only).

Deliberately naive: one session, one token at a time, K/V kept in plain Python lists,
the visible key set computed directly from the policy definition in `kv.residency`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metronome.kv.residency import ResidencyPolicy
from metronome.model import rope
from metronome.model.llama import LlamaModel, rms_norm


def visible_keys(policy: ResidencyPolicy, p: int, block_size: int) -> list[int]:
    start = policy.window_start(p, block_size)
    return [j for j in range(p + 1) if j < policy.sink_tokens or j >= start]


def reference_logits(
    model: LlamaModel, token_ids: list[int], policy: ResidencyPolicy, block_size: int,
    rolling: bool = False,
) -> torch.Tensor:
    """Logits (T, vocab) for a token sequence, decoding one token at a time.

    absolute: keys rotated at their own position (masked dense attention).
    rolling: StreamingLLM; keys kept before RoPE and, for every query, re-rotated at their
    slot in the cache (sinks first, then the window); the query sits at the last slot.
    """
    cfg = model.config
    group = cfg.num_heads // cfg.num_kv_heads
    keys = [[] for _ in model.layers]  # per layer: (kvh, hd) pre-RoPE keys by position
    values = [[] for _ in model.layers]
    out = []
    for p, token in enumerate(token_ids):
        x = model.embed(torch.tensor([token]))
        visible = visible_keys(policy, p, block_size)
        key_pos = torch.tensor(list(range(len(visible))) if rolling else visible)
        q_pos = torch.tensor([len(visible) - 1 if rolling else p])
        for li, w in enumerate(model.layers):
            h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
            q, k, v = F.linear(h, w.qkv, w.qkv_bias).split(
                (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                 cfg.num_kv_heads * cfg.head_dim), dim=-1)
            q = q.view(1, cfg.num_heads, cfg.head_dim)
            k = k.view(1, cfg.num_kv_heads, cfg.head_dim)
            if w.q_norm is not None:
                q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
            keys[li].append(k[0])
            values[li].append(v.view(cfg.num_kv_heads, cfg.head_dim))
            kk = torch.stack([keys[li][j] for j in visible])  # (n, kvh, hd)
            vv = torch.stack([values[li][j] for j in visible])
            kk = rope.apply(kk, *rope.cos_sin(key_pos, model.inv_freq, kk.dtype))
            qq = rope.apply(q, *rope.cos_sin(q_pos, model.inv_freq, q.dtype))[0]  # (H, hd)
            kk = kk.repeat_interleave(group, dim=1)  # (n, H, hd)
            vv = vv.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", qq.float(), kk.float()) * cfg.head_dim**-0.5
            attn = torch.einsum("hn,nhd->hd", scores.softmax(-1), vv.float()).to(x.dtype)
            x = x + F.linear(attn.reshape(1, -1), w.o)
            h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
            gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down)
        out.append(F.linear(rms_norm(x, model.final_norm, cfg.rms_norm_eps), model.lm_head))
    return torch.cat(out).float()
