// y = x @ w.T (+ bias) for the few rows of a decode step: bfloat16 on AVX512-BF16, float32 on
// AVX2 with FMA.
//
// With a handful of rows a projection is a pass over its weight: 269 MB for the bundled
// model's step in bf16, 538 MB in float32. oneDNN's prepacked product (`model.linear`) reads
// it at ~19 GB/s at 8 rows in bf16 on an AVX512-BF16 host; this kernel reads the plain
// row-major weight (which `Projection` keeps anyway) as a stream, a few weight rows at a time
// (2 in bf16, 3 in float32), and prefetches it. bf16: 1.2-1.5x faster than oneDNN at 1-8
// rows, no faster from 16 (measured by `metronome bench engine`'s GEMM table); from 2 rows
// each group prefetches the group 4 ahead while it computes, as float32 does (the bundled
// model's 121 projections from memory, AVX512-BF16 Zen 4: 1.1x faster at 8 rows than a burst
// per group, 1.05x at 2-4; at 1 row the burst stays, 1.05x faster there). float32 on an
// AVX2 Zen 3, the model's projections from memory side by side: 1.2-1.4x faster than oneDNN
// at 1-16 rows since each group prefetches the next while it computes and x's vectors stay in
// registers (before: 1.05-1.25x at 1-8, slower at 16).
//
// bf16: each output is one float32 sum of exact bf16 products (`vdpbf16ps`) in the order of k,
// rounded to bf16 once. float32: eight float32 partial sums per output (lane l: k = l mod 8,
// in the order of k), added at the end. Either way a row's result does not depend on the
// rows beside it or on their number.
//
// Layout: x (M, K) and w (N, K) contiguous, both bf16 or both float32; bias (N,) of their
// dtype or none; returns (M, N).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "fold.h"

namespace {

constexpr int kRowTile = 8;  // rows of x per micro-tile: 2 x 8 accumulators
// bf16 (AVX512-BF16 hosts) at 1 row: each group asks for its weight lines 4 KiB ahead of its
// rows, all at once before its loads (a loop of 2 products per line has no room for more
// instructions). From 2 rows the tile prefetches instead (see tile), this many groups ahead
// (2 groups ahead measured 1.1x slower at 2 rows than 3 or 4; 4 and 8 the same at 8 rows).
// float32 does not prefetch in bursts (see tile_f32).
constexpr int64_t kPrefetchBytesBf16 = 4096;
constexpr int64_t kPrefetchGroupsBf16 = 4;

#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;

// Rows [0, MT) of x against weight rows w0 and w1: out[2m + j] = x[m] . w_j. A function of
// its own, compiled per row count, so that its 16 accumulators stay in registers.
// With `ahead` (2 x K values: a later group's rows, contiguous) it asks for one line of
// `ahead` per line of each row it reads, so the memory streams that group while these
// products run; the prefetches change no result.
template <int MT>
__attribute__((noinline)) void tile(const at::BFloat16* x, const at::BFloat16* w0,
                                    const at::BFloat16* w1, int64_t K,
                                    const at::BFloat16* ahead, float* out) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t whole = K / 32 * 32;
  for (int64_t k = 0; k < whole; k += 32) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + k);
    const __m512bh b = (__m512bh)_mm512_loadu_si512(w1 + k);
    if (ahead != nullptr) {
      __builtin_prefetch(ahead + 2 * k, 0, 1);
      __builtin_prefetch(ahead + 2 * k + 32, 0, 1);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512bh xm = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      acc[2 * m] = _mm512_dpbf16_ps(acc[2 * m], xm, a);
      acc[2 * m + 1] = _mm512_dpbf16_ps(acc[2 * m + 1], xm, b);
    }
  }
  if (whole < K) {  // the last K % 32 (zeros past the end add nothing)
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - whole)) - 1);
    const __m512bh a = (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + whole);
    const __m512bh b = (__m512bh)_mm512_maskz_loadu_epi16(mask, w1 + whole);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xm = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + whole);
      acc[2 * m] = _mm512_dpbf16_ps(acc[2 * m], xm, a);
      acc[2 * m + 1] = _mm512_dpbf16_ps(acc[2 * m + 1], xm, b);
    }
  }
  _mm512_storeu_ps(out, fold16(acc));
}

using TileFn = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, int64_t,
                        const at::BFloat16*, float*);
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

// The weight's rows `kGroup` at a time over the threads, run through
// `tile(x_rows, group_rows, rows, sums)` for every tile of rows of x (sums[kGroup * m + j]:
// row m of the tile against the group's row j). A last group short of rows repeats its first
// row in their place, and their sums are dropped.
// With `prefetch_bytes` >= 0 each group first asks for its rows' lines that far ahead, all at
// once; with -1 the tile prefetches, if it does.
template <typename T, int kTile, int kGroup, typename Tile>
void over_weight_groups(const T* xp, const T* wp, const T* bp, T* yp, int64_t M, int64_t K,
                        int64_t N, int64_t prefetch_bytes, Tile tile) {
  const int64_t groups = (N + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kGroup * kTile];
    const T* rows_of[kGroup];
    float bias_of[kGroup];
    for (int64_t group = begin; group < end; ++group) {
      const int64_t n0 = kGroup * group;
      const int real = static_cast<int>(std::min<int64_t>(kGroup, N - n0));
      for (int j = 0; j < kGroup; ++j) {
        rows_of[j] = wp + (n0 + (j < real ? j : 0)) * K;
        bias_of[j] = bp != nullptr && j < real ? static_cast<float>(bp[n0 + j]) : 0.f;
      }
      if (prefetch_bytes >= 0) {
        const char* ahead = reinterpret_cast<const char*>(rows_of[0]) + prefetch_bytes;
        for (int64_t off = 0; off < kGroup * K * static_cast<int64_t>(sizeof(T)); off += 64)
          __builtin_prefetch(ahead + off, 0, 1);
      }
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

torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& w,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "small_linear: x (M, K) and w (N, K) expected");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(w.scalar_type() == dtype && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "small_linear: x and w must both be bfloat16 or both float32");
  TORCH_CHECK(dtype == at::kFloat || kAvailable,
              "this build has no AVX512-BF16 (bfloat16 projections use oneDNN)");
  TORCH_CHECK(dtype == at::kBFloat16 || kFloat32Available,
              "this build has no AVX2 with FMA (float32 projections use oneDNN)");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == dtype,
                "small_linear: bias must be contiguous (N,) of x's dtype");
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
    using T = at::BFloat16;
    const bool burst = M == 1;
    const T* xp = x.data_ptr<T>();
    over_weight_groups<T, kRowTile, 2>(
        xp, w.data_ptr<T>(), bias.has_value() ? bias->data_ptr<T>() : nullptr,
        y.data_ptr<T>(), M, K, N, burst ? kPrefetchBytesBf16 : -1,
        [K, burst, xp](const T* xs, const T* const* ws, int rows, float* sums) {
          // the group kPrefetchGroupsBf16 ahead starts that many pairs of rows after this
          // one's (past the weight's end it asks for nothing it needs: a prefetch never
          // faults); only the first tile of rows of x asks, the rest find the lines there
          const T* ahead =
              burst || xs != xp ? nullptr : ws[0] + kPrefetchGroupsBf16 * 2 * K;
          kTiles[rows](xs, ws[0], ws[1], K, ahead, sums);
        });
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (dtype == at::kFloat) {
    over_weight_groups<float, kRowTileF32, 3>(
        x.data_ptr<float>(), w.data_ptr<float>(),
        bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N,
        -1, [K](const float* xs, const float* const* ws, int rows, float* sums) {
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
        "y = x @ w.T (+ bias) in bf16 or float32 for a few rows of x",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("w"),
        py::arg("bias") = py::none());
}
