"""The dense fp64 reference of sinks+window attention, from raw per-request K/V."""

from __future__ import annotations

import torch


def dense_reference(keys, values, query, seq_lens, query_lens, bound, scale):
    """From the raw K/V: each query's visible set straight from the rule, in fp64."""
    out, t = [], 0
    group = query.shape[1] // keys[0].shape[1]
    for k, v, seq_len, q_len in zip(keys, values, seq_lens, query_lens, strict=True):
        for p in range(seq_len - q_len, seq_len):
            js = [j for j in range(p + 1) if j < bound.sink_tokens or p - j < bound.window_tokens]
            kk = k[js].double().repeat_interleave(group, dim=1)  # (n, H, hd)
            vv = v[js].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", query[t].double(), kk) * scale
            out.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), vv))
            t += 1
    return torch.stack(out)
