// The paged kernel's attention task for bf16 K/V at head size kD on AVX512-BF16 (see
// paged_attention.cpp for what a task is and which keys it sees).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attend_common.h"
#include "fold.h"
#include "vec_exp.h"

namespace metronome_attend {

#if defined(__AVX512BF16__)
// The same task for bf16 at head size kD (a multiple of 32) on AVX512-BF16, 16 keys at a
// time: each key's dot products with the group's queries as `vdpbf16ps` partials (exact bf16
// products, float32 sums) folded 16 keys into one vector (`fold16`: lane j = key j); the
// softmax on those vectors; the chunk's values widened to float32 once and accumulated for
// every head. The generic task (`attend_task` in paged_attention.cpp) computes each dot as a
// float32 loop with a horizontal sum per key and head, and converted every key and value
// once per head: 3-4x slower here.

// bf16 row (16 values) -> float32
inline __m512 widen(const at::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// acc[h] += sum over the chunk's seen keys j of probs[h][j] * V[j], for G heads at once: each
// value row widened once and folded into every head's accumulators (G x kD/16 independent
// FMA chains; head by head, 4 chains per head left the FMA unit waiting on their latency).
// Each head sums its keys in order, so any grouping of the heads gives the same bits.
template <int kD, int G>
inline void values_chunk(float (*acc)[kD], const float (*probs)[16], const at::BFloat16* vr,
                         int n, __mmask16 seen) {
  constexpr int kV = kD / 16;
  __m512 a[G][kV];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < kV; ++v) a[h][v] = _mm512_load_ps(acc[h] + v * 16);
  for (int j = 0; j < n; ++j) {
    if (!((seen >> j) & 1)) continue;
    __m512 p[G];
    for (int h = 0; h < G; ++h) p[h] = _mm512_set1_ps(probs[h][j]);
    for (int v = 0; v < kV; ++v) {
      const __m512 x = widen(vr + j * kD + v * 16);
      for (int h = 0; h < G; ++h) a[h][v] = _mm512_fmadd_ps(p[h], x, a[h][v]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < kV; ++v) _mm512_store_ps(acc[h] + v * 16, a[h][v]);
}

template <int kD>
void attend_task_bf16(const at::BFloat16* q, const at::BFloat16* q_sink,
                      const at::BFloat16* k_base, const at::BFloat16* v_base,
                      const int64_t* blocks, const int64_t* logical, int64_t num_blocks,
                      int64_t block_size, int64_t position, int64_t window_start,
                      int64_t sink_tokens, int64_t sink_blocks, int group, float scale,
                      at::BFloat16* out) {
  constexpr int kS = kD / 32;  // 32-dim slices of a row: one vector of 16 bf16 pairs each
  constexpr int kV = kD / 16;  // float32 vectors of a row
  __m512i qv[kMaxGroup][kS], qsv[kMaxGroup][kS];
  alignas(64) float acc[kMaxGroup][kD];
  alignas(64) float probs[kMaxGroup][16];
  float run_max[kMaxGroup], run_sum[kMaxGroup];
  for (int h = 0; h < group; ++h) {
    for (int s = 0; s < kS; ++s) {
      qv[h][s] = _mm512_loadu_si512(q + h * kD + s * 32);
      qsv[h][s] = q_sink != nullptr ? _mm512_loadu_si512(q_sink + h * kD + s * 32) : qv[h][s];
    }
    for (int d = 0; d < kD; ++d) acc[h][d] = 0.f;
    run_max[h] = kMasked;
    run_sum[h] = 0.f;
  }
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 vscale = _mm512_set1_ps(scale), masked = _mm512_set1_ps(kMasked);
  const bool far = g_bf16_far_prefetch.load(std::memory_order_relaxed);
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t first = logical[i] * block_size;
    if (first > position) break;
    if (first >= sink_tokens && first + block_size <= window_start) continue;
    const __m512i(*qq)[kS] = i < sink_blocks ? qsv : qv;
    const at::BFloat16* kb = k_base + blocks[i] * block_size * kD;
    const at::BFloat16* vb = v_base + blocks[i] * block_size * kD;
    // Prefetch, a chunk's worth alongside each chunk of this block: the next block and the
    // one after it, both into L2 (prefetcht2). Measured here, 30 layers' KV from memory:
    // 1.25-1.3x over asking for the whole next block up front (the line-fill queue idles
    // for most of the block), 1.3-1.45x more over the next block alone into L1, whose misses
    // from DRAM held the L1's few miss buffers; and on an AVX512-BF16 Zen 4, 1.1x more with
    // the next block into L2 rather than into L1 (prefetcht0), where its requests still
    // held those buffers whenever the block after next had not arrived. The block after
    // next is asked for in two parts spread through the chunk's work (its keys after the
    // scores, its values after the weighted sum), not in one burst before it: 30 layers of
    // a decode step's attention from memory (8 bounded sessions) 3.96-4.15 vs 4.71-4.89 ms
    // in three 60-round runs in one process (0.84-0.85x; 0.80-0.99x in four shorter runs),
    // and the same with K/V in cache (0.99x). Asking for the next block only once (it was
    // asked for as the block after next) was 1.18x slower: the second request is needed.
    // On a 2-core Sapphire Rapids-class Xeon (AMX) the block after next costs instead: the
    // next block alone was 0.86x the time at 32 sessions x 4k unbounded and 0.89x at 8
    // bounded (`scripts/attention_ab.py`), so there it is off (`far`, set by vendor).
    const bool next = i + 1 < num_blocks, after_next = far && i + 2 < num_blocks;
    const char* k_next = block_bytes<kD>(k_base, blocks[next ? i + 1 : i], block_size);
    const char* v_next = block_bytes<kD>(v_base, blocks[next ? i + 1 : i], block_size);
    const char* k_after = block_bytes<kD>(k_base, blocks[after_next ? i + 2 : i], block_size);
    const char* v_after = block_bytes<kD>(v_base, blocks[after_next ? i + 2 : i], block_size);
    for (int64_t j0 = 0; j0 < block_size; j0 += 16) {
      const int64_t col0 = first + j0;
      if (col0 > position) break;
      const int n = static_cast<int>(std::min<int64_t>(16, block_size - j0));
      const __m512i cols = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(col0)), iota);
      const __mmask16 seen =
          _mm512_cmple_epi32_mask(cols, _mm512_set1_epi32(static_cast<int>(position))) &
          (_mm512_cmplt_epi32_mask(cols, _mm512_set1_epi32(static_cast<int>(sink_tokens))) |
           _mm512_cmpge_epi32_mask(cols, _mm512_set1_epi32(static_cast<int>(window_start)))) &
          static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
      const int64_t chunk_begin = j0 * kD * 2, chunk_end = (j0 + n) * kD * 2;  // bytes
      for (int64_t off = chunk_begin; next && off < chunk_end; off += 64) {
        __builtin_prefetch(k_next + off, 0, 1);
        __builtin_prefetch(v_next + off, 0, 1);
      }
      if (seen == 0) {
        if (after_next) {
          prefetch_l2(k_after, chunk_begin, chunk_end);
          prefetch_l2(v_after, chunk_begin, chunk_end);
        }
        continue;
      }
      const at::BFloat16* kr = kb + j0 * kD;
      for (int h = 0; h < group; ++h) {
        __m512 part[16];
        for (int j = 0; j < 16; ++j) {
          part[j] = _mm512_setzero_ps();
          if (j < n)
            for (int s = 0; s < kS; ++s)
              part[j] = _mm512_dpbf16_ps(part[j], (__m512bh)qq[h][s],
                                         (__m512bh)_mm512_loadu_si512(kr + j * kD + s * 32));
        }
        const __m512 score = _mm512_mask_mul_ps(masked, seen, fold16(part), vscale);
        const float chunk_max = _mm512_reduce_max_ps(score);
        if (chunk_max > run_max[h]) {
          const float rescale = std::exp(run_max[h] - chunk_max);
          run_sum[h] *= rescale;
          const __m512 r = _mm512_set1_ps(rescale);
          for (int v = 0; v < kV; ++v)
            _mm512_store_ps(acc[h] + v * 16, _mm512_mul_ps(_mm512_load_ps(acc[h] + v * 16), r));
          run_max[h] = chunk_max;
        }
        const __m512 p = _mm512_maskz_mov_ps(
            seen, exp_nonpositive(_mm512_sub_ps(score, _mm512_set1_ps(run_max[h]))));
        run_sum[h] += _mm512_reduce_add_ps(p);
        _mm512_store_ps(probs[h], p);
      }
      if (after_next) prefetch_l2(k_after, chunk_begin, chunk_end);
      const at::BFloat16* vr = vb + j0 * kD;
      for (int h0 = 0; h0 < group; h0 += 4) {  // up to 4 heads a pass (SmolLM2: its 3 in one)
        switch (std::min(4, group - h0)) {
          case 1: values_chunk<kD, 1>(acc + h0, probs + h0, vr, n, seen); break;
          case 2: values_chunk<kD, 2>(acc + h0, probs + h0, vr, n, seen); break;
          case 3: values_chunk<kD, 3>(acc + h0, probs + h0, vr, n, seen); break;
          default: values_chunk<kD, 4>(acc + h0, probs + h0, vr, n, seen); break;
        }
      }
      if (after_next) prefetch_l2(v_after, chunk_begin, chunk_end);
    }
  }
  for (int h = 0; h < group; ++h) {
    const float inv = 1.f / run_sum[h];
    for (int d = 0; d < kD; ++d) out[h * kD + d] = static_cast<at::BFloat16>(acc[h][d] * inv);
  }
}
#endif

}  // namespace metronome_attend
