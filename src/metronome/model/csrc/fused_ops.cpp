// Fused elementwise kernels for the forward pass: one pass over memory instead of torch's
// chain of small ops (each a full read and write of the activations, several with a dtype
// round trip). They reproduce the reference ops of metronome.model.llama / rope rounding for
// rounding: every intermediate the reference rounds to the activation dtype is rounded here
// too (c10's float -> bf16/half conversion rounds to nearest even, as torch's ops do), so the
// only differences are float reassociation in the sums (a few ulp of float32).
//
//   rms_norm(x, w, eps)          w * round(xf * rsqrt(mean(xf^2) + eps))
//   add_rms_norm(x, d, w, eps)   s = round(x + d); (s, rms_norm(s, w, eps))
//   silu_mul(gate_up)            round(round(silu(gate)) * up), gate and up the two halves
//   rope(x, cos, sin)            round(round(x * cos) + round(rotate_half(x) * sin))
//   argmax_rows(logits)          each row's first maximal index, as torch.argmax(dim=-1)
//
// Layouts: x (T, H) with unit stride in H (rows may be strided, e.g. views of a fused qkv);
// rope's x (T, heads, D) with unit stride in D; cos/sin (T, 1, D) contiguous.
// Compiled by metronome.model.native.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "rope_row.h"

namespace {

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

// rows per task: small tensors (a decode step's few rows) stay on one thread
inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

template <typename scalar_t>
void norm_row(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t H, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < H; ++i) {
    const float v = f(x[i]);
    sum += v * v;
  }
  const float r = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) {
    out[i] = round_to<scalar_t>(f(w[i]) * f(round_to<scalar_t>(f(x[i]) * r)));
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (T, H) with unit stride in H");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "weight must be contiguous (H,)");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w);
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0);
  auto out = torch::empty({T, H}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) norm_row(xp + t * xs, wp, op + t * H, H, (float)eps);
    });
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor d,
                                                      torch::Tensor w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(d.sizes() == x.sizes() && d.stride(1) == 1 && d.scalar_type() == x.scalar_type(),
              "the addend must match x");
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0), ds = d.stride(0);
  auto sum = torch::empty({T, H}, x.options());
  auto out = torch::empty({T, H}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = d.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* srow = sp + t * H;
        for (int64_t i = 0; i < H; ++i) {
          srow[i] = round_to<scalar_t>(f(xp[t * xs + i]) + f(dp[t * ds + i]));
        }
        norm_row(srow, wp, op + t * H, H, (float)eps);
      }
    });
  });
  return {sum, out};
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be (T, 2I) with unit stride in its last dim");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows(I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = gp + t * gs;
        const scalar_t* u = g + I;
        scalar_t* o = op + t * I;
        for (int64_t i = 0; i < I; ++i) {
          const float x = f(g[i]);
          const float s = f(round_to<scalar_t>(x / (1.f + std::exp(-x))));
          o[i] = round_to<scalar_t>(s * f(u[i]));
        }
      }
    });
  });
  return out;
}

torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be (T, heads, D) with unit stride in D, D even");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D &&
              sin.numel() == T * D, "cos and sin must be contiguous (T, 1, D)");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos, sin and x must share a dtype");
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  auto out = torch::empty({T, NH, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, grain_rows(NH * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cp + t * D;
        const scalar_t* s = sp + t * D;
        for (int64_t h = 0; h < NH; ++h) {
          const scalar_t* xr = xp + t * s0 + h * s1;
          rope_row(xr, c, s, op + (t * NH + h) * D, D);
        }
      }
    });
  });
  return out;
}

// NaN by its bits: the build's -ffast-math lets the compiler assume std::isnan is false
inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// The first index of a float32 row's maximum, or of its first NaN (torch.argmax counts NaN
// as the maximum). torch's argmax walks a row one value at a time: a greedy step's logits
// (8 rows x 49,152) took it 0.35 ms on 2 cores of a Zen 1-class EPYC, a fifth of the
// engine's bookkeeping there. Here 8 lanes each keep their own first maximum (a strict `>`
// keeps the earliest), and the lanes' ties go to the smallest index: the same answer.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best_i = 0;
  float best = x[0];
#if defined(__AVX2__)
  if (n >= 16) {
    __m256 vbest = _mm256_loadu_ps(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i cur = vidx;
    __m256 nan = _mm256_cmp_ps(vbest, vbest, _CMP_UNORD_Q);
    const __m256i step = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 gt = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vbest = _mm256_blendv_ps(vbest, v, gt);
      vidx = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
    }
    if (_mm256_movemask_ps(nan) != 0) {  // a NaN before i: the first one is the answer
      for (int64_t j = 0; j < i; ++j)
        if (is_nan(x[j])) return j;
    }
    alignas(32) float vals[8];
    alignas(32) int32_t idx[8];
    _mm256_store_ps(vals, vbest);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idx), vidx);
    best = vals[0], best_i = idx[0];
    for (int l = 1; l < 8; ++l)
      if (vals[l] > best || (vals[l] == best && idx[l] < best_i)) best = vals[l], best_i = idx[l];
  }
#endif
  for (; i < n; ++i) {  // the tail (or the whole row without AVX2), in order; no NaN before i
    if (is_nan(x[i])) return i;
    if (x[i] > best) best = x[i], best_i = i;
  }
  return best_i;
}

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: contiguous float32 (rows, n > 0) expected");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31) - 8, "argmax_rows: rows over 2^31 values");
  const int64_t R = logits.size(0), n = logits.size(1);
  auto out = torch::empty({R}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, std::max<int64_t>(1, 65536 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm as metronome.model.llama.rms_norm rounds it");
  m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm: (sum, normed)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up over a fused (T, 2I) gate_up");
  m.def("rope", &rope, "rotate-half RoPE as metronome.model.rope.apply rounds it");
  m.def("argmax_rows", &argmax_rows, "each row's first maximal index (torch.argmax(dim=-1))");
}
