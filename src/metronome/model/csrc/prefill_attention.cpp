// Attention probabilities of long dense chunks (prefill) in bfloat16, on AVX512-BF16.
//
// torch's CPU flash attention reaches ~100-145 GFLOP/s here in bf16: oneDNN cannot pack
// bf16 brgemm tiles on a CPU without AMX (`cpublas::could_pack` is false), so its tiles fall
// back to a reference GEMM. A bf16 `bmm` (oneDNN matmul) reaches ~500 GFLOP/s but rounds its
// output to bf16, which for scores would be 5x the error of the fused path. So the dense
// path splits attention in two: this kernel computes each row's scores in float32 with
// `vdpbf16ps` (exact bf16 products, float32 sums), masks them, takes the softmax in float32
// and writes the probabilities in bf16 (as torch's flash kernel rounds them before its
// P.V product); torch's bf16 `matmul` then multiplies them by V.
//
// Layout: q (R, M, D) with R = kv heads x sessions (r = h * B + b) and M = group x Q query
// rows (row m is query m % Q of session b); k (R, C, D); attend (B, Q, C) bool, the dense
// path's visibility (`engine.batch_builder._dense`). Writes probs (R, M, C) bf16: a buffer
// the caller keeps for every layer of a step (a fresh 10-40 MB tensor per layer costs more in
// page faults than the softmax itself).
// One task = one (kv head, session): K is repacked once per task into 16-key groups of
// dimension pairs (the layout `vdpbf16ps` reads), then 4 query rows x 64 keys at a time,
// over the keys any of the 4 rows sees (whole 16-key groups; the rest of a row is zero):
// a chunk's causal tail, a window's start. The micro-tile is a function of its own
// (noinline): inlined into the task loop, GCC spilled its 16 accumulators and reloaded K
// per row, and the scores ran at a third of `vdpbf16ps`'s peak (measured: 1.5-2x slower).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_exp.h"

namespace {

constexpr int kRows = 4;      // query rows per micro-tile
constexpr int kGroups = 4;    // 16-key groups per micro-tile (64 keys)
constexpr int kMaxD = 256;

#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;

// K (C, D) bf16 -> packed[g / kGroups][d2][g % kGroups][t] = the (2 d2, 2 d2 + 1) pair of
// key 16 g + t, as u32 (a micro-tile's K for one d2 is one contiguous 256 B run); keys
// past C are zero (their scores are masked anyway).
void pack_keys(const uint32_t* k, int64_t C, int64_t pairs, uint32_t* packed) {
  const int64_t groups = (C + 15) / 16;
  for (int64_t g = 0; g < groups; ++g) {
    uint32_t* out = packed + (g / kGroups) * pairs * kGroups * 16 + (g % kGroups) * 16;
    for (int t = 0; t < 16; ++t) {
      const int64_t key = g * 16 + t;
      if (key < C) {
        const uint32_t* row = k + key * pairs;
        for (int64_t d2 = 0; d2 < pairs; ++d2) out[d2 * kGroups * 16 + t] = row[d2];
      } else {
        for (int64_t d2 = 0; d2 < pairs; ++d2) out[d2 * kGroups * 16 + t] = 0;
      }
    }
  }
}

// What a task's micro-tiles share: ROWS query rows (`pairs` u32 apart) against packed K;
// `visible` the rows' attend rows (C bools each); `scores` ld floats per row; `rmax` each
// row's running max.
struct Tile {
  const uint32_t* q;
  int64_t pairs;
  const uint32_t* packed;
  const bool* const* visible;
  int64_t C;
  float scale;
  float* scores;
  int64_t ld;
  __m512* rmax;
};

// The rows' scores against NG 16-key groups from g0 (a multiple of kGroups): float32 sums of
// exact bf16 products, scaled, masked (hidden: -3e38), stored, and into each row's max.
// Compiled for fixed ROWS and NG, out of line, so the accumulators stay in registers.
template <int ROWS, int NG>
__attribute__((noinline)) void score_tile(const Tile& t, int64_t g0) {
  const int64_t pairs = t.pairs;
  __m512 acc[ROWS][NG];
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_setzero_ps();
  const uint32_t* kp = t.packed + (g0 / kGroups) * pairs * kGroups * 16;
  for (int64_t d2 = 0; d2 < pairs; ++d2) {
    __m512i kv[NG];
    for (int g = 0; g < NG; ++g) kv[g] = _mm512_loadu_si512(kp + (d2 * kGroups + g) * 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512i qb = _mm512_set1_epi32(static_cast<int>(t.q[r * pairs + d2]));
      for (int g = 0; g < NG; ++g)
        acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)qb, (__m512bh)kv[g]);
    }
  }
  const __m512 hidden = _mm512_set1_ps(-3.0e38f);
  const __m512 vscale = _mm512_set1_ps(t.scale);
  for (int r = 0; r < ROWS; ++r)
    for (int g = 0; g < NG; ++g) {
      const int64_t c = (g0 + g) * 16;
      const __mmask16 tail = t.C - c >= 16 ? 0xFFFF : (__mmask16)((1u << (t.C - c)) - 1);
      const __m128i bytes = _mm_maskz_loadu_epi8(tail, t.visible[r] + c);
      const __mmask16 seen = _mm_test_epi8_mask(bytes, bytes);
      const __m512 x = _mm512_mask_mul_ps(hidden, seen, acc[r][g], vscale);
      _mm512_storeu_ps(t.scores + r * t.ld + c, x);
      t.rmax[r] = _mm512_max_ps(t.rmax[r], x);
    }
}

// The rows' scores over the groups [glo, ghi) (glo a multiple of kGroups).
template <int ROWS>
void score_range(const Tile& t, int64_t glo, int64_t ghi) {
  int64_t g = glo;
  for (; g + kGroups <= ghi; g += kGroups) score_tile<ROWS, kGroups>(t, g);
  switch (ghi - g) {  // the range's last groups
    case 3: score_tile<ROWS, 3>(t, g); break;
    case 2: score_tile<ROWS, 2>(t, g); break;
    case 1: score_tile<ROWS, 1>(t, g); break;
    default: break;
  }
}

// One row's probabilities from its scaled, masked scores over [c0, c1) (a multiple of 16
// wide, within the padded row) and their max: softmax in float32, bf16 into out[0, C)
// (zeros outside [c0, c1), where every key is hidden).
inline void softmax_row(float* s, float row_max, int64_t c0, int64_t c1, int64_t C,
                        at::BFloat16* out) {
  const __m512 mx = _mm512_set1_ps(row_max);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t c = c0; c < c1; c += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + c), mx));
    _mm512_storeu_ps(s + c, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
  const int64_t end = std::min(c1, C);
  if (c0 > 0) std::memset(out, 0, c0 * sizeof(at::BFloat16));
  for (int64_t c = c0; c < end; c += 16) {
    const __mmask16 tail = end - c >= 16 ? 0xFFFF : (__mmask16)((1u << (end - c)) - 1);
    const __m256bh p = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + c), inv));
    _mm256_mask_storeu_epi16(out + c, tail, (__m256i)p);
  }
  if (end < C) std::memset(out + end, 0, (C - end) * sizeof(at::BFloat16));
}
#else
constexpr bool kAvailable = false;
#endif

}  // namespace

bool available() { return kAvailable; }

void attention_probs(torch::Tensor q, torch::Tensor k, torch::Tensor attend, double scale,
                     torch::Tensor probs) {
  TORCH_CHECK(kAvailable, "this build has no AVX512-BF16 (the dense path uses SDPA)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16,
              "q and k must be bfloat16");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && attend.is_contiguous(),
              "q, k and attend must be contiguous");
  TORCH_CHECK(attend.scalar_type() == at::kBool && attend.dim() == 3, "attend: (B, Q, C) bool");
  const int64_t R = q.size(0), M = q.size(1), D = q.size(2), C = k.size(1);
  const int64_t B = attend.size(0), Q = attend.size(1);
  TORCH_CHECK(D % 2 == 0 && D <= kMaxD, "head size must be even and <= ", kMaxD);
  TORCH_CHECK(k.size(0) == R && k.size(2) == D && attend.size(2) == C && R % B == 0 &&
              M % Q == 0, "shapes disagree");
  TORCH_CHECK(probs.scalar_type() == at::kBFloat16 && probs.is_contiguous() &&
              probs.numel() == R * M * C, "probs: a contiguous (R, M, C) bf16 buffer");
#if defined(__AVX512BF16__)
  const int64_t pairs = D / 2, groups = (C + 15) / 16, padded = groups * 16;
  const auto* qp = reinterpret_cast<const uint32_t*>(q.data_ptr<at::BFloat16>());
  const auto* kp = reinterpret_cast<const uint32_t*>(k.data_ptr<at::BFloat16>());
  const bool* ap = attend.data_ptr<bool>();
  auto* pp = probs.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);
  // each row's visible range, padded to whole 16-key groups: keys outside it are skipped
  std::vector<int32_t> lo(B * Q), hi(B * Q);
  at::parallel_for(0, B * Q, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bool* row = ap + i * C;
      int64_t a = 0, z = C;
      while (a < C && !row[a]) ++a;
      while (z > a && !row[z - 1]) --z;
      lo[i] = static_cast<int32_t>(a / 16);
      hi[i] = static_cast<int32_t>((z + 15) / 16);
    }
  });
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> packed(((groups + kGroups - 1) / kGroups) * kGroups * pairs * 16);
    std::vector<float> scores(kRows * padded);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r % B;
      pack_keys(kp + r * C * pairs, C, pairs, packed.data());
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        const uint32_t* qrows = qp + (r * M + m0) * pairs;
        const bool* visible[kRows];
        int64_t glo = groups, ghi = 0;
        for (int i = 0; i < kRows; ++i) {
          const int64_t qi = b * Q + (m0 + std::min(i, rows - 1)) % Q;
          visible[i] = ap + qi * C;
          glo = std::min<int64_t>(glo, lo[qi]);
          ghi = std::max<int64_t>(ghi, hi[qi]);
        }
        if (ghi <= glo) glo = 0, ghi = 1;  // rows that see nothing (padding): any values
        glo -= glo % kGroups;
        __m512 rmax[kRows];
        for (int i = 0; i < kRows; ++i) rmax[i] = _mm512_set1_ps(-3.0e38f);
        const Tile tile{qrows, pairs, packed.data(), visible, C, fscale, scores.data(),
                        padded, rmax};
        switch (rows) {  // M's last rows
          case 4: score_range<4>(tile, glo, ghi); break;
          case 3: score_range<3>(tile, glo, ghi); break;
          case 2: score_range<2>(tile, glo, ghi); break;
          default: score_range<1>(tile, glo, ghi); break;
        }
        for (int i = 0; i < rows; ++i) {
          const int64_t m = m0 + i;
          softmax_row(scores.data() + i * padded, _mm512_reduce_max_ps(rmax[i]), glo * 16,
                      ghi * 16, C, pp + (r * M + m) * C);
        }
      }
    }
  });
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX512-BF16 kernel");
  m.def("attention_probs", &attention_probs,  // without the GIL, as torch's own ops run
        "probs = softmax(scale q k^T | attend) per (kv head, session): float32 scores, bf16 probs",
        py::call_guard<py::gil_scoped_release>());
}
