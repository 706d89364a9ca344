// y = x @ w.T (+ bias) in bfloat16 for the few rows of a decode step, on AVX512-BF16.
//
// With a handful of rows a projection is a pass over its weight: 269 MB for the bundled
// model's step. oneDNN's prepacked product (`model.linear`) reads it at ~19 GB/s at 8 rows
// here; this kernel reads the plain row-major weight (which `Projection` keeps anyway) as a
// stream, two weight rows at a time, and prefetches it 4 KiB ahead into L2: 1.2-1.5x faster
// at 1-8 rows on this project's machines, no faster from 16 (measured by
// `metronome bench engine`'s GEMM table). Each output is one float32 sum of exact bf16
// products (`vdpbf16ps`) in the order of k, whatever the row count, rounded to bf16 once.
//
// Layout: x (M, K) and w (N, K) contiguous bf16; bias (N,) bf16 or none; returns (M, N).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "fold16.h"

namespace {

constexpr int kRowTile = 8;  // rows of x per micro-tile: 2 x 8 accumulators
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the weight rows in use

#if defined(__AVX512BF16__)
constexpr bool kAvailable = true;

// Rows [0, MT) of x against weight rows w0 and w1: out[2m + j] = x[m] . w_j. A function of
// its own, compiled per row count, so that its 16 accumulators stay in registers.
template <int MT>
__attribute__((noinline)) void tile(const at::BFloat16* x, const at::BFloat16* w0,
                                    const at::BFloat16* w1, int64_t K, float* out) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t whole = K / 32 * 32;
  for (int64_t k = 0; k < whole; k += 32) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + k);
    const __m512bh b = (__m512bh)_mm512_loadu_si512(w1 + k);
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
                        float*);
constexpr TileFn kTiles[kRowTile + 1] = {nullptr,  tile<1>, tile<2>, tile<3>, tile<4>,
                                         tile<5>,  tile<6>, tile<7>, tile<8>};
#else
constexpr bool kAvailable = false;
#endif

}  // namespace

bool available() { return kAvailable; }

torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& w,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(kAvailable, "this build has no AVX512-BF16 (projections use oneDNN)");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "small_linear: x (M, K) and w (N, K) expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_linear: x and w must be bfloat16");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: x and w must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16,
                "small_linear: bias must be contiguous bfloat16 (N,)");
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
#if defined(__AVX512BF16__)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = w.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t pairs = (N + 1) / 2;  // weight rows two at a time (an odd N: the last alone)
  at::parallel_for(0, pairs, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[16];
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t n0 = 2 * pair;
      const bool both = n0 + 1 < N;
      const at::BFloat16* w0 = wp + n0 * K;
      const at::BFloat16* w1 = both ? w0 + K : w0;
      const char* ahead = reinterpret_cast<const char*>(w0) + kPrefetchBytes;
      for (int64_t off = 0; off < 2 * K * 2; off += 64) __builtin_prefetch(ahead + off, 0, 1);
      const float b0 = bp != nullptr ? static_cast<float>(bp[n0]) : 0.f;
      const float b1 = bp != nullptr && both ? static_cast<float>(bp[n0 + 1]) : 0.f;
      for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - m0));
        kTiles[rows](xp + m0 * K, w0, w1, K, sums);
        for (int m = 0; m < rows; ++m) {
          yp[(m0 + m) * N + n0] = static_cast<at::BFloat16>(sums[2 * m] + b0);
          if (both) yp[(m0 + m) * N + n0 + 1] = static_cast<at::BFloat16>(sums[2 * m + 1] + b1);
        }
      }
    }
  });
#endif
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX512-BF16 kernel");
  m.def("small_linear", &small_linear, "y = x @ w.T (+ bias) in bf16 for a few rows of x",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
}
