// The paged kernel's attention task for float32 K/V at head size kD on AVX2 with FMA (see
// paged_attention.cpp for what a task is and which keys it sees), 8 keys at a time: each
// key's dot products with a query head as 8-lane partial sums, the 8 keys' folded into one
// vector (`fold8`: lane j = key j) with no horizontal sum per key; the softmax on that
// vector (`exp_nonpositive`); each value row read once per pass and folded into up to 3
// heads' accumulators held in registers. The generic task (`attend_task`) sums every dot
// product horizontally and keeps its accumulators in memory.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "attend_common.h"
#include "fold.h"
#include "vec_exp.h"

namespace metronome_attend {

#if defined(__AVX2__) && defined(__FMA__)
inline float max8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float sum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// acc[h][c0, c0 + 8 kW) += sum over the chunk's seen keys j of probs[h][j] * V[j] for G
// heads: G x kW accumulators, G broadcasts and one value vector in AVX2's 16 registers.
template <int kD, int G, int kW>
inline void values_pass(float (*acc)[kD], const float (*probs)[8], const float* vr, int n,
                        unsigned seen, int c0) {
  __m256 a[G][kW];
  for (int h = 0; h < G; ++h)
    for (int w = 0; w < kW; ++w) a[h][w] = _mm256_load_ps(acc[h] + c0 + 8 * w);
  for (int j = 0; j < n; ++j) {
    if (!((seen >> j) & 1u)) continue;
    __m256 p[G];
    for (int h = 0; h < G; ++h) p[h] = _mm256_broadcast_ss(probs[h] + j);
    for (int w = 0; w < kW; ++w) {
      // the value vector once into a register for its G FMAs (else GCC folds it into each
      // FMA as a memory operand: G loads where one does, as in small_linear.cpp's tile_f32).
      // Same bits; 8 sessions' windows, 30 layers: 1.21x faster with the KV in cache, from
      // memory (a step's case: bandwidth-bound) 1.00-1.06x
      __m256 x = _mm256_loadu_ps(vr + j * kD + c0 + 8 * w);
      asm("" : "+x"(x));
      for (int h = 0; h < G; ++h) a[h][w] = _mm256_fmadd_ps(p[h], x, a[h][w]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int w = 0; w < kW; ++w) _mm256_store_ps(acc[h] + c0 + 8 * w, a[h][w]);
}

template <int kD, int G>
inline void values_chunk_f32(float (*acc)[kD], const float (*probs)[8], const float* vr, int n,
                             unsigned seen) {
  constexpr int kW = G == 1 ? 8 : 4;  // vectors of a row per pass
  static_assert(kD % (8 * kW) == 0, "head size must be a multiple of a pass");
  for (int c0 = 0; c0 < kD; c0 += 8 * kW) values_pass<kD, G, kW>(acc, probs, vr, n, seen, c0);
}

template <int kD>
void attend_task_f32(const float* q, const float* q_sink, const float* k_base,
                     const float* v_base, const int64_t* blocks, const int64_t* logical,
                     int64_t num_blocks, int64_t block_size, int64_t position,
                     int64_t window_start, int64_t sink_tokens, int64_t sink_blocks, int group,
                     float scale, float* out) {
  constexpr int kV = kD / 8;  // float32 vectors of a row
  alignas(32) float qf[kMaxGroup][kD];
  alignas(32) float qs[kMaxGroup][kD];
  alignas(32) float acc[kMaxGroup][kD];
  alignas(32) float probs[kMaxGroup][8];
  float run_max[kMaxGroup], run_sum[kMaxGroup];
  for (int h = 0; h < group; ++h) {
    for (int d = 0; d < kD; ++d) {  // scaled before the dot products, as the generic task
      qf[h][d] = q[h * kD + d] * scale;
      qs[h][d] = q_sink != nullptr ? q_sink[h * kD + d] * scale : qf[h][d];
      acc[h][d] = 0.f;
    }
    run_max[h] = kMasked;
    run_sum[h] = 0.f;
  }
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 masked = _mm256_set1_ps(kMasked);
  // keys visible to the query: col <= position and (col < sinks or col >= window_start)
  const __m256i after_position = _mm256_set1_epi32(static_cast<int>(position + 1));
  const __m256i sinks = _mm256_set1_epi32(static_cast<int>(sink_tokens));
  const __m256i before_window = _mm256_set1_epi32(static_cast<int>(window_start - 1));
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t first = logical[i] * block_size;
    if (first > position) break;
    if (first >= sink_tokens && first + block_size <= window_start) continue;
    const float(*qq)[kD] = i < sink_blocks ? qs : qf;
    const float* kb = k_base + blocks[i] * block_size * kD;
    const float* vb = v_base + blocks[i] * block_size * kD;
    // the next block into L1 and the one after into L2, a chunk's worth beside each chunk,
    // as the bf16 task (blocks are scattered: the hardware prefetcher restarts at each).
    // Measured on a Zen 3, 8 sessions' windows from memory: no prefetch 1.2x slower; the
    // after-next block alone, or both at the L2 hint, the same as this.
    const bool next = i + 1 < num_blocks, after_next = i + 2 < num_blocks;
    const char* k_next = block_bytes<kD>(k_base, blocks[next ? i + 1 : i], block_size);
    const char* v_next = block_bytes<kD>(v_base, blocks[next ? i + 1 : i], block_size);
    const char* k_after = block_bytes<kD>(k_base, blocks[after_next ? i + 2 : i], block_size);
    const char* v_after = block_bytes<kD>(v_base, blocks[after_next ? i + 2 : i], block_size);
    for (int64_t j0 = 0; j0 < block_size; j0 += 8) {
      const int64_t col0 = first + j0;
      if (col0 > position) break;
      const int n = static_cast<int>(std::min<int64_t>(8, block_size - j0));
      const __m256i cols = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(col0)), iota);
      const __m256i live = _mm256_and_si256(
          _mm256_and_si256(_mm256_cmpgt_epi32(after_position, cols),
                           _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota)),
          _mm256_or_si256(_mm256_cmpgt_epi32(sinks, cols),
                          _mm256_cmpgt_epi32(cols, before_window)));
      const __m256 live_ps = _mm256_castsi256_ps(live);
      const unsigned seen = static_cast<unsigned>(_mm256_movemask_ps(live_ps));
      const int64_t chunk_begin = j0 * kD * 4, chunk_end = (j0 + n) * kD * 4;  // bytes
      for (int64_t off = chunk_begin; next && off < chunk_end; off += 64) {
        __builtin_prefetch(k_next + off, 0, 3);
        __builtin_prefetch(v_next + off, 0, 3);
      }
      for (int64_t off = chunk_begin; after_next && off < chunk_end; off += 64) {
        __builtin_prefetch(k_after + off, 0, 1);
        __builtin_prefetch(v_after + off, 0, 1);
      }
      if (seen == 0) continue;
      const float* kr = kb + j0 * kD;
      for (int h = 0; h < group; ++h) {
        // one query vector against the chunk's keys per slice: 8 independent FMA chains
        __m256 part[8];
        for (int j = 0; j < 8; ++j) part[j] = _mm256_setzero_ps();
        for (int s = 0; s < kV; ++s) {
          const __m256 qv = _mm256_load_ps(qq[h] + 8 * s);
          for (int j = 0; j < 8; ++j)
            if (j < n)
              part[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr + j * kD + 8 * s), part[j]);
        }
        const __m256 score = _mm256_blendv_ps(masked, fold8(part), live_ps);
        const float chunk_max = max8(score);
        if (chunk_max > run_max[h]) {
          const float rescale = std::exp(run_max[h] - chunk_max);
          run_sum[h] *= rescale;
          const __m256 r = _mm256_set1_ps(rescale);
          for (int v = 0; v < kV; ++v)
            _mm256_store_ps(acc[h] + v * 8, _mm256_mul_ps(_mm256_load_ps(acc[h] + v * 8), r));
          run_max[h] = chunk_max;
        }
        const __m256 p = _mm256_and_ps(
            live_ps, exp_nonpositive(_mm256_sub_ps(score, _mm256_set1_ps(run_max[h]))));
        run_sum[h] += sum8(p);
        _mm256_store_ps(probs[h], p);
      }
      const float* vr = vb + j0 * kD;
      for (int h0 = 0; h0 < group; h0 += 3) {  // up to 3 heads a pass (SmolLM2: its 3 in one)
        switch (std::min(3, group - h0)) {
          case 1: values_chunk_f32<kD, 1>(acc + h0, probs + h0, vr, n, seen); break;
          case 2: values_chunk_f32<kD, 2>(acc + h0, probs + h0, vr, n, seen); break;
          default: values_chunk_f32<kD, 3>(acc + h0, probs + h0, vr, n, seen); break;
        }
      }
    }
  }
  for (int h = 0; h < group; ++h) {
    const float inv = 1.f / run_sum[h];
    for (int d = 0; d < kD; ++d) out[h * kD + d] = acc[h][d] * inv;
  }
}
#endif

}  // namespace metronome_attend
