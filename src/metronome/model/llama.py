"""Our Llama-family forward pass (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Owns the weights and the math of one batched step; knows nothing of sessions or policies:
those arrive as a `ForwardBatch` (positions, slots, and per attention path either block
tables for the compiled paged kernel or gather indices and a mask for the dense path).

Rolling positions without re-rotating keys: RoPE makes a score depend only on
`p_q - p_k`. Keys are stored rotated at their absolute position. In the StreamingLLM
layout a window key keeps its distance to the query (`p - j`), so the absolute score is
already right; only sink keys get a shorter distance (`r(p) - j`, with `r(p)` the query's
slot in the cache). So sink columns are scored with a second copy of q rotated at `r(p)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metronome.kv.cache import KVCache
from metronome.model import rope
from metronome.model.batch import DenseAttention, ForwardBatch
from metronome.model.config import ModelConfig
from metronome.model.linear import Projection, packing_supported
from metronome.model.spans import in_span


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # (q_dim + 2 * kv_dim, hidden): q, k, v projections fused
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # (head_dim,) Qwen3
    k_norm: torch.Tensor | None
    o: torch.Tensor  # (hidden, q_dim)
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor  # (2 * intermediate, hidden): gate and up fused
    down: torch.Tensor  # (hidden, intermediate)


PAGED_ATTENTION_EVENT = "metronome::paged_attention"


@dataclass
class _LayerProjections:
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 as the reference implementations do, then cast back.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
    ) -> None:
        self.config = config
        self.embed_tokens = embed  # (vocab, hidden)
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # (vocab, hidden); the same tensor as embed when tied
        self.inv_freq = rope.inv_frequencies(config.head_dim, config.rope_theta)
        self.q_dim = config.num_heads * config.head_dim
        self.kv_dim = config.num_kv_heads * config.head_dim
        self.use_packed_linear(packing_supported(embed.dtype))
        self.use_fused_ops(True)
        self.use_prefill_kernel(True)

    def use_packed_linear(self, enabled: bool, few_rows: bool = True) -> None:
        """Run the projections as prepacked oneDNN products (`model.linear`), with the few-row
        kernel for decode steps where it applies unless `few_rows` is False, or as plain
        `F.linear` on the weights (the reference); the weights themselves stay as loaded."""
        self.packed_linear = enabled
        self.projections = [
            _LayerProjections(*(Projection(weight, bias, enabled, few_rows) for weight, bias in
                                ((w.qkv, w.qkv_bias), (w.o, None), (w.gate_up, None),
                                 (w.down, None))))
            for w in self.layers
        ]
        self.lm_head_projection = Projection(self.lm_head, None, enabled, few_rows)

    def use_fused_ops(self, enabled: bool) -> None:
        """Run RMSNorm (with the residual add), SiLU-and-multiply and RoPE as the fused kernels
        of `native.fused_ops` (same rounding as torch's ops, one pass over memory each) when
        they build here, or as torch's ops (the reference)."""
        from metronome.model import native

        self.fused = native.fused_ops() if enabled else None

    def use_prefill_kernel(self, enabled: bool) -> None:
        """On the fast path (a paged kernel passed to `forward`), run the attention of long
        dense chunks as `native.prefill_attention` (float32 scores from bf16 products, bf16
        probabilities, torch's bf16 matmul for P.V: over 2.5x torch's SDPA on AVX512-BF16
        without AMX) when it builds here, the model is bf16 and torch's SDPA does not run on
        AMX tiles here (`native.sdpa_packs_amx_tiles`: there SDPA is the faster); else, and
        always on the reference path, torch's SDPA."""
        from metronome.model import native

        self.prefill = (native.prefill_attention() if enabled and self.dtype == torch.bfloat16
                        and not native.sdpa_packs_amx_tiles() else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_tokens)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, kernel=None) -> torch.Tensor:
        """Run every layer; returns float32 logits for `batch.logits_index` rows: (R, vocab).

        `kernel`: the compiled paged-attention module (`metronome.model.native.kernel()`);
        needed when the batch has a paged part."""
        assert batch.paged is None or kernel is not None, "a paged batch needs the kernel"
        x = batch.inputs_embeds
        cos, sin = rope.cos_sin(batch.positions, self.inv_freq, x.dtype)
        sink_rope = None
        if batch.sink_positions is not None:
            sink_rope = rope.cos_sin(batch.sink_positions, self.inv_freq, x.dtype)
        dense = batch.dense
        buffers = fused_mask = probs = None
        if dense is not None:
            buffers = cache.gather_buffers(dense.block_ids)
        if dense is not None and kernel is not None and self.prefill is not None and (
                dense.sink_cols is None):  # rolling sinks: the explicit path below
            rows = self.config.num_kv_heads * dense.batch_size
            group = self.config.num_heads // self.config.num_kv_heads
            # one buffer for every layer's probabilities: a fresh one per layer costs more
            # in page faults than the softmax
            probs = torch.empty(rows, group * dense.max_chunk_tokens,
                                dense.attend.shape[-1], dtype=x.dtype)
        elif dense is not None:
            # (kvh * B, 1, Q, C): the step's mask in the fused kernel's layout, built once, and
            # additive (0 / -inf): SDPA would turn a boolean mask into one in every layer
            kvh = self.config.num_kv_heads
            attend = dense.attend.expand(kvh, *dense.attend.shape[1:]).reshape(
                kvh * dense.batch_size, 1, dense.max_chunk_tokens, -1)
            fused_mask = torch.zeros(attend.shape, dtype=x.dtype).masked_fill_(
                ~attend, float("-inf"))
        h = self._norm(x, self.layers[0].attn_norm)
        last = len(self.layers) - 1
        for layer_idx, (w, proj) in enumerate(zip(self.layers, self.projections, strict=True)):
            attn = self._attention(layer_idx, w, proj, h, batch, cache, buffers, (cos, sin),
                                   sink_rope, fused_mask, probs, kernel)
            x, h = self._add_norm(x, attn, w.mlp_norm)
            mlp = proj.down(self._silu_mul(proj.gate_up(h)))
            if layer_idx < last:
                x, h = self._add_norm(x, mlp, self.layers[layer_idx + 1].attn_norm)
        rows = batch.logits_index
        x = x.index_select(0, rows) + mlp.index_select(0, rows)
        x = self._norm(x, self.final_norm)
        return self.lm_head_projection(x).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor):
        """(x + delta, its RMSNorm with `weight`): the residual stream and the next input."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, delta, weight, self.config.rms_norm_eps)
        x = x + delta
        return x, rms_norm(x, weight, self.config.rms_norm_eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.rope(x, cos, sin)
        return rope.apply(x, cos, sin)

    def _attention(self, layer_idx, w, proj, h, batch, cache, buffers, rope_cs, sink_rope,
                   fused_mask, probs, kernel):
        cos, sin = rope_cs
        cfg = self.config
        tokens = h.shape[0]
        qkv = proj.qkv(h)
        if (kernel is not None and self.fused is not None and batch.dense is None
                and sink_rope is None and w.q_norm is None):
            return proj.o(self._paged_from_qkv(layer_idx, qkv, batch, cache, rope_cs, kernel))
        q, k, v = qkv.split((self.q_dim, self.kv_dim, self.kv_dim), dim=-1)
        q = q.view(tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        cache.write(layer_idx, batch.slot_ids, self._rope(k, cos, sin), v)
        q_rot = self._rope(q, cos, sin)
        outs = []
        split = 0 if batch.paged is None else batch.paged.num_tokens
        if batch.paged is not None:
            outs.append(self._paged_attention(layer_idx, q, q_rot, batch.paged, cache, sink_rope,
                                              kernel))
        if batch.dense is not None:
            dense_rope = None if sink_rope is None else (sink_rope[0][split:], sink_rope[1][split:])
            outs.append(self._dense_attention(layer_idx, q[split:], q_rot[split:], batch.dense,
                                              cache, buffers, dense_rope, fused_mask, probs))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return proj.o(out)

    def _paged_attention(self, layer_idx, q, q_rot, paged, cache, sink_rope, kernel):
        """The compiled kernel over the first `paged.num_tokens` rows, reading K/V in place."""
        n = paged.num_tokens
        q_sink = None
        if sink_rope is not None and paged.has_sink_blocks:
            q_sink = rope.apply(q[:n], sink_rope[0][:n], sink_rope[1][:n]).contiguous()
        return in_span(PAGED_ATTENTION_EVENT, kernel.paged_attention, q_rot[:n].contiguous(),
                       q_sink, cache.k[layer_idx], cache.v[layer_idx],
                       *self._paged_tail(paged, cache))

    def _paged_from_qkv(self, layer_idx, qkv, batch, cache, rope_cs, kernel):
        """A step all on the paged path without rolling sinks, in one kernel call: RoPE, the
        K/V write and the attention (`rope_write_attend`; the same bits as the fused `rope`,
        `cache.write` and `paged_attention` it replaces)."""
        paged = batch.paged
        assert paged.num_tokens == qkv.shape[0]
        return in_span(PAGED_ATTENTION_EVENT, kernel.rope_write_attend, qkv, *rope_cs,
                       cache.k[layer_idx], cache.v[layer_idx], batch.slot_ids,
                       self.config.num_heads, *self._paged_tail(paged, cache))

    def _paged_tail(self, paged, cache) -> tuple:
        """The paged kernel's arguments after q and the layer's K/V: the step's tokens and
        block tables, the block size and the softmax scale."""
        return (paged.token_session, paged.token_positions, paged.token_window_start,
                paged.block_ids, paged.block_logical, paged.num_blocks, paged.sink_tokens,
                paged.sink_blocks, cache.block_size, self.config.head_dim**-0.5)

    def _dense_attention(self, layer_idx, q, q_rot, dense, cache, buffers, sink_rope, fused_mask,
                         probs):
        """Gather every session's blocks, pad queries, mask: the prefill kernel into `probs`
        (when given), fused SDPA (the reference), or the explicit path for rolling sinks."""
        keys, values = cache.gather(layer_idx, dense.block_ids, buffers)  # (kvh, B, C, hd)
        q_grouped = self._group(q_rot, dense)  # (kvh, B, group * Q, hd)
        if probs is not None:
            out = self._prefill_attention(q_grouped, keys, values, dense, probs)
        elif dense.sink_cols is None:
            out = self._fused_attention(q_grouped, keys, values, dense, fused_mask)
        else:  # rolling sinks need their own scores: the explicit path
            keys_t = keys.transpose(-1, -2)  # (kvh, B, hd, C): BLAS reads the transpose in place
            scores = torch.matmul(q_grouped, keys_t)
            q_sink = self._group(rope.apply(q, *sink_rope), dense)
            n = dense.sink_cols.shape[-1]
            sink_scores = torch.matmul(q_sink, keys_t[..., :n])
            scores[..., :n] = torch.where(dense.sink_cols, sink_scores, scores[..., :n])
            out = self._softmax_values(scores, values, dense)  # (B * Q, heads * hd)
        if dense.padded_index is not None:
            out = out.index_select(0, dense.padded_index)
        return out

    def _group(self, q: torch.Tensor, batch: DenseAttention) -> torch.Tensor:
        """(T, heads, hd) -> (kvh, B, group * Q, hd): query heads sharing a kv head together."""
        cfg = self.config
        b, q_len = batch.batch_size, batch.max_chunk_tokens
        if batch.padded_index is not None:
            padded = q.new_zeros(b * q_len, cfg.num_heads, cfg.head_dim)
            q = padded.index_copy_(0, batch.padded_index, q)
        group = cfg.num_heads // cfg.num_kv_heads
        q = q.view(b, q_len, cfg.num_kv_heads, group, cfg.head_dim).permute(2, 0, 3, 1, 4)
        return q.reshape(cfg.num_kv_heads, b, group * q_len, cfg.head_dim)

    def _prefill_attention(self, q_grouped, keys, values, batch, probs) -> torch.Tensor:
        """`native.prefill_attention`'s probabilities (float32 scores), then P.V in bf16."""
        cfg = self.config
        b, q_len = batch.batch_size, batch.max_chunk_tokens
        group = cfg.num_heads // cfg.num_kv_heads
        rows, ctx = cfg.num_kv_heads * b, keys.shape[-2]
        self.prefill.attention_probs(q_grouped.reshape(rows, group * q_len, cfg.head_dim),
                                     keys.reshape(rows, ctx, cfg.head_dim),
                                     batch.attend.view(b, q_len, ctx), cfg.head_dim**-0.5,
                                     probs)
        out = torch.matmul(probs, values.reshape(rows, ctx, cfg.head_dim))  # (rows, g*Q, hd)
        out = out.view(cfg.num_kv_heads, b, group, q_len, cfg.head_dim).permute(1, 3, 0, 2, 4)
        return out.reshape(b * q_len, cfg.num_heads * cfg.head_dim)

    def _fused_attention(self, q_grouped, keys, values, batch, mask) -> torch.Tensor:
        """torch's fused SDPA with each (kv head, session) pair as one batch entry."""
        cfg = self.config
        b, q_len = batch.batch_size, batch.max_chunk_tokens
        group = cfg.num_heads // cfg.num_kv_heads
        rows = cfg.num_kv_heads * b
        out = F.scaled_dot_product_attention(
            q_grouped.reshape(rows, group, q_len, cfg.head_dim),
            keys.view(rows, 1, -1, cfg.head_dim), values.view(rows, 1, -1, cfg.head_dim),
            attn_mask=mask, enable_gqa=True,
        )  # (kvh * B, group, Q, hd)
        out = out.view(cfg.num_kv_heads, b, group, q_len, cfg.head_dim).permute(1, 3, 0, 2, 4)
        return out.reshape(b * q_len, cfg.num_heads * cfg.head_dim)

    def _softmax_values(self, scores, values, batch) -> torch.Tensor:
        cfg = self.config
        b, q_len = batch.batch_size, batch.max_chunk_tokens
        group = cfg.num_heads // cfg.num_kv_heads
        scores = scores.view(cfg.num_kv_heads, b, group, q_len, -1).float()
        scores = scores.mul_(cfg.head_dim**-0.5).masked_fill_(~batch.attend, float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        probs = probs.view(cfg.num_kv_heads, b, group * q_len, -1)
        out = torch.matmul(probs, values)  # (kvh, B, group * Q, hd)
        out = out.view(cfg.num_kv_heads, b, group, q_len, cfg.head_dim).permute(1, 3, 0, 2, 4)
        return out.reshape(b * q_len, cfg.num_heads * cfg.head_dim)
