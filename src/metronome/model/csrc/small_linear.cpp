// y = x @ w.T (+ bias) for the few rows of a decode step: bfloat16 on AVX512-BF16, float32 on
// AVX2 with FMA.
//
// With a handful of rows a projection is a pass over its weight: 269 MB for the bundled
// model's step in bf16, 538 MB in float32. oneDNN's prepacked product (`model.linear`) reads
// it at ~19 GB/s at 8 rows in bf16 on an AVX512-BF16 host; this kernel streams the weight a
// few rows at a time (2 in bf16, 3 in float32) and prefetches it while it computes.
//
// bf16 reads a copy of the weight packed once (`pack_bf16`, which `Projection` keeps): each
// pair of rows as one run of memory, their 32-value pieces alternating in the order the
// kernel reads them. The row-major weight made each pair two short streams 2 x K bytes
// apart, which the hardware prefetchers barely follow (without software prefetch it read at
// 10 GB/s, the packed copy at 23); with each group prefetching 8 KiB ahead of itself in its
// loop, the bundled model's 121 projections from memory on an AVX512-BF16 Zen 4 run
// 1.1-1.2x faster at 8 rows than on the row-major weight (which prefetched 4 groups ahead),
// 1.05x at 4, 1.1x at 1, the same at 2. Against oneDNN: 1.2-1.5x faster at 1-8 rows before
// the packing, no faster from 16 (`metronome bench engine`'s GEMM table). float32 on an
// AVX2 Zen 3, the model's projections from memory side by side: 1.2-1.4x faster than oneDNN
// at 1-16 rows since each group prefetches the next while it computes and x's vectors stay in
// registers (before: 1.05-1.25x at 1-8, slower at 16).
//
// bf16: each output is one float32 sum of exact bf16 products (`vdpbf16ps`) in the order of k,
// rounded to bf16 once. float32: eight float32 partial sums per output (lane l: k = l mod 8,
// in the order of k), added at the end. Either way a row's result does not depend on the
// rows beside it or on their number.
//
// Layout: x (M, K) contiguous; w (N, K) contiguous of x's dtype (bf16 or float32), or for
// bf16 `pack_bf16(w)` with `out_features` N; bias (N,) of their dtype or none; returns (M, N).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "fold.h"

namespace {

constexpr int kRowTile = 8;  // rows of x per micro-tile: 2 x 8 accumulators
// bf16: a group asks for the packed weight this far ahead of the piece it reads (4 KiB
// measured 1.05-1.1x slower at 2-8 rows, 16 KiB the same as 8)
constexpr int64_t kPrefetchBytesBf16 = 8192;
constexpr int64_t kPiece = 32;  // values of a row per packed piece: one vector of bf16 pairs

#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;

// Rows [0, MT) of x against a packed pair of weight rows (`pair`: their pieces alternating,
// zeros past K): out[2m + j] = x[m] . w_j. A function of its own, compiled per row count, so
// that its 16 accumulators stay in registers. With `ahead` it asks for one line of it per
// line of the pair it reads, so the memory streams what follows while these products run;
// the prefetches change no result.
template <int MT>
__attribute__((noinline)) void tile(const at::BFloat16* x, const at::BFloat16* pair, int64_t K,
                                    const char* ahead, float* out) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t whole = K / kPiece * kPiece;
  for (int64_t k = 0; k < whole; k += kPiece) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(pair + 2 * k);
    const __m512bh b = (__m512bh)_mm512_loadu_si512(pair + 2 * k + kPiece);
    if (ahead != nullptr) {  // 4k bytes: the pieces before k, of both rows
      __builtin_prefetch(ahead + 4 * k, 0, 1);
      __builtin_prefetch(ahead + 4 * k + 64, 0, 1);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xm = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      acc[2 * m] = _mm512_dpbf16_ps(acc[2 * m], xm, a);
      acc[2 * m + 1] = _mm512_dpbf16_ps(acc[2 * m + 1], xm, b);
    }
  }
  if (whole < K) {  // the last K % 32 of x (the packed pieces hold zeros past K)
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - whole)) - 1);
    const __m512bh a = (__m512bh)_mm512_loadu_si512(pair + 2 * whole);
    const __m512bh b = (__m512bh)_mm512_loadu_si512(pair + 2 * whole + kPiece);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xm = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + whole);
      acc[2 * m] = _mm512_dpbf16_ps(acc[2 * m], xm, a);
      acc[2 * m + 1] = _mm512_dpbf16_ps(acc[2 * m + 1], xm, b);
    }
  }
  _mm512_storeu_ps(out, fold16(acc));
}

using TileFn = void (*)(const at::BFloat16*, const at::BFloat16*, int64_t, const char*, float*);
constexpr TileFn kTiles[kRowTile + 1] = {nullptr,  tile<1>, tile<2>, tile<3>, tile<4>,
                                         tile<5>,  tile<6>, tile<7>, tile<8>};
#else
constexpr bool kAvailable = false;
#endif

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kFloat32Available = true;
// rows of x per float32 micro-tile, against 3 weight rows: 12 accumulators, 3 weight vectors
// and one row of x fill AVX2's 16 registers, and 12 independent FMA chains cover Zen 3's two
// FMA pipes' latency (4 x 2 accumulators, 8 chains, ran the in-cache product at half the FMA
// peak: 1.2x slower at 8 rows)
constexpr int kRowTileF32 = 4;

// Rows [0, MT) of x against weight rows w[0..2]: out[3m + j] = x[m] . w_j (float32).
//
// While it reads its rows it asks for the next group's (the 3 x K floats from `ahead`), 3
// lines per line of each row it reads, so the memory streams the next rows while the FMAs
// run on these: a burst of prefetches per group left the core waiting on the memory and the
// memory idle while the core computed (the model's projections from memory, AVX2 Zen 3, side
// by side: 1.2-1.3x faster at 4-8 rows than asking for the group's own rows before its loads,
// the same at 1; prefetching 2/3 or 2 groups ahead measured the same as 1).
template <int MT>
__attribute__((noinline)) void tile_f32(const float* x, const float* const* w, int64_t K,
                                        const float* ahead, float* out) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
  const float *w0 = w[0], *w1 = w[1], *w2 = w[2];
  const int64_t whole = K / 8 * 8;
  for (int64_t k = 0; k < whole; k += 8) {
    const __m256 a = _mm256_loadu_ps(w0 + k);
    const __m256 b = _mm256_loadu_ps(w1 + k);
    const __m256 c = _mm256_loadu_ps(w2 + k);
    if ((k & 15) == 0) {  // a line of each row begins at k
      __builtin_prefetch(ahead + 3 * k, 0, 1);
      __builtin_prefetch(ahead + 3 * k + 16, 0, 1);
      __builtin_prefetch(ahead + 3 * k + 32, 0, 1);
    }
    for (int m = 0; m < MT; ++m) {
      // x's vector once into a register for its 3 FMAs: left alone, GCC folds it into each
      // FMA as a memory operand, 15 loads per 12 FMAs where 7 do, and Zen 3's two 256-bit
      // loads a cycle then bound the product (in L3 at 8 rows: 90 GFLOP/s against 69)
      __m256 xm = _mm256_loadu_ps(x + m * K + k);
      asm("" : "+x"(xm));
      acc[3 * m] = _mm256_fmadd_ps(xm, a, acc[3 * m]);
      acc[3 * m + 1] = _mm256_fmadd_ps(xm, b, acc[3 * m + 1]);
      acc[3 * m + 2] = _mm256_fmadd_ps(xm, c, acc[3 * m + 2]);
    }
  }
  if (whole < K) {  // the last K % 8 (zeros past the end add nothing)
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(K - whole)), lanes);
    const __m256 a = _mm256_maskload_ps(w0 + whole, mask);
    const __m256 b = _mm256_maskload_ps(w1 + whole, mask);
    const __m256 c = _mm256_maskload_ps(w2 + whole, mask);
    for (int m = 0; m < MT; ++m) {
      const __m256 xm = _mm256_maskload_ps(x + m * K + whole, mask);
      acc[3 * m] = _mm256_fmadd_ps(xm, a, acc[3 * m]);
      acc[3 * m + 1] = _mm256_fmadd_ps(xm, b, acc[3 * m + 1]);
      acc[3 * m + 2] = _mm256_fmadd_ps(xm, c, acc[3 * m + 2]);
    }
  }
  _mm256_storeu_ps(out, fold8(acc));
  _mm_storeu_ps(out + 8, fold4(acc + 8));
}

using TileF32Fn = void (*)(const float*, const float* const*, int64_t, const float*, float*);
constexpr TileF32Fn kTilesF32[kRowTileF32 + 1] = {nullptr, tile_f32<1>, tile_f32<2>,
                                                  tile_f32<3>, tile_f32<4>};
#else
constexpr bool kFloat32Available = false;
#endif

// The weight's rows `kGroup` at a time over the threads: `rows_of_group(group, rows_of)` says
// where group's rows lie (a last group short of rows may repeat one in their place: their
// sums are dropped), then `tile(x_rows, rows_of, rows, sums)` runs for every tile of rows of
// x (sums[kGroup * m + j]: row m of the tile against the group's row j).
template <typename T, int kTile, int kGroup, typename Rows, typename Tile>
void over_weight_groups(const T* xp, const T* bp, T* yp, int64_t M, int64_t N,
                        int64_t K, Rows rows_of_group, Tile tile) {
  const int64_t groups = (N + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kGroup * kTile];
    const T* rows_of[kGroup];
    float bias_of[kGroup];
    for (int64_t group = begin; group < end; ++group) {
      const int64_t n0 = kGroup * group;
      const int real = static_cast<int>(std::min<int64_t>(kGroup, N - n0));
      rows_of_group(group, rows_of);
      for (int j = 0; j < kGroup; ++j)
        bias_of[j] = bp != nullptr && j < real ? static_cast<float>(bp[n0 + j]) : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kTile, M - m0));
        tile(xp + m0 * K, rows_of, rows, sums);
        for (int m = 0; m < rows; ++m)
          for (int j = 0; j < real; ++j)
            yp[(m0 + m) * N + n0 + j] = static_cast<T>(sums[kGroup * m + j] + bias_of[j]);
      }
    }
  });
}

}  // namespace

bool available() { return kAvailable; }

bool float32_available() { return kFloat32Available; }

// bf16 w (N, K) as the kernel reads it: (ceil(N / 2), ceil(K / 32), 2, 32), piece c of the
// pair (2g, 2g + 1) at [g][c] (row 2g's values then row 2g + 1's), zeros past N and K.
torch::Tensor pack_bf16(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "pack_bf16: a bfloat16 weight (N, K) expected");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t pairs = (N + 1) / 2, pieces = (K + kPiece - 1) / kPiece;
  const torch::Tensor padded = at::constant_pad_nd(w, {0, pieces * kPiece - K, 0, 2 * pairs - N});
  return padded.view({pairs, 2, pieces, kPiece}).transpose(1, 2).contiguous();
}

torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& w,
                           const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2, "small_linear: x (M, K) expected");
  TORCH_CHECK(w.scalar_type() == dtype && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "small_linear: x and w must both be bfloat16 or both float32");
  TORCH_CHECK(dtype == at::kFloat || kAvailable,
              "this build has no AVX512-BF16 (bfloat16 projections use oneDNN)");
  TORCH_CHECK(dtype == at::kBFloat16 || kFloat32Available,
              "this build has no AVX2 with FMA (float32 projections use oneDNN)");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  const bool packed = w.dim() == 4;
  if (packed) {
    TORCH_CHECK(dtype == at::kBFloat16 && w.size(2) == 2 && w.size(3) == kPiece &&
                    w.size(1) == (K + kPiece - 1) / kPiece && out_features > 0 &&
                    (out_features + 1) / 2 == w.size(0),
                "small_linear: a packed w must be pack_bf16 of an (out_features, K) weight");
  } else {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K, "small_linear: x (M, K) and w (N, K) expected");
    TORCH_CHECK(out_features < 0 || out_features == w.size(0),
                "small_linear: out_features differs from w's rows");
  }
  const int64_t N = packed ? out_features : w.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == dtype,
                "small_linear: bias must be contiguous (N,) of x's dtype");
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
    using T = at::BFloat16;
    // a plain weight is packed for this call (tests, one-off products); `Projection` packs once
    const torch::Tensor pairs = packed ? w : pack_bf16(w);
    const T* pp = pairs.data_ptr<T>();
    const int64_t pair_values = pairs.size(1) * 2 * kPiece;
    const T* xp = x.data_ptr<T>();
    over_weight_groups<T, kRowTile, 2>(
        xp, bias.has_value() ? bias->data_ptr<T>() : nullptr, y.data_ptr<T>(), M, N, K,
        [pp, pair_values](int64_t group, const T** rows_of) {
          // a packed pair is one run: both rows' slots hold its start, which the tile reads
          rows_of[0] = rows_of[1] = pp + group * pair_values;
        },
        [K, xp](const T* xs, const T* const* rows_of, int rows, float* sums) {
          // only the first tile of rows of x asks (the rest find the lines there); past the
          // weight's end a prefetch asks for nothing it needs and never faults
          const char* ahead = xs == xp ? reinterpret_cast<const char*>(rows_of[0]) +
                                             kPrefetchBytesBf16
                                       : nullptr;
          kTiles[rows](xs, rows_of[0], K, ahead, sums);
        });
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (dtype == at::kFloat) {
    const float* wp = w.data_ptr<float>();
    over_weight_groups<float, kRowTileF32, 3>(
        x.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
        y.data_ptr<float>(), M, N, K,
        [wp, N, K](int64_t group, const float** rows_of) {
          for (int j = 0; j < 3; ++j)
            rows_of[j] = wp + std::min<int64_t>(3 * group + j, N - 1) * K;
        },
        [K](const float* xs, const float* const* ws, int rows, float* sums) {
          // the next group's 3 rows follow this group's (past the weight's end, the prefetches
          // of a last group ask for nothing it needs; a prefetch never faults); a group's
          // later tiles of rows of x ask again for lines mostly there (the same speed as
          // asking in its first tile only, and simpler)
          kTilesF32[rows](xs, ws, K, ws[0] + 3 * K, sums);
        });
  }
#endif
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX512-BF16 kernel");
  m.def("float32_available", &float32_available,
        "whether this build has the float32 kernel (AVX2 with FMA)");
  // without the GIL, as torch's own ops run: a projection is up to ~6 ms of the engine's
  // thread (lm_head in float32), and the server's event loop must not wait for it
  m.def("small_linear", &small_linear,
        "y = x @ w.T (+ bias) in bf16 or float32 for a few rows of x; w plain (N, K) or, in "
        "bf16, pack_bf16's copy with out_features = N",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none(), py::arg("out_features") = -1);
  m.def("pack_bf16", &pack_bf16,
        "a bf16 weight (N, K) packed as the few-row kernel reads it (pairs of rows as runs)",
        py::arg("w"));
}
