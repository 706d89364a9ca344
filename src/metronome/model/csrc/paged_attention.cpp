// Paged attention over the KV pool in place: no gather copy, no padding, no mask tensor.
//
// One task = (query token, kv head). It walks its session's resident blocks in logical
// order, scores the block's keys for every query head of the kv head's group at once
// (each key is read once per group), and folds them into a running softmax (max, sum,
// weighted values) in float32. Which keys a query sees is the residency contract of
// metronome.kv.residency, computed per column from positions:
//     key j visible to query p  <=>  j <= p  and  (j < sink_tokens  or  j >= window_start)
// and, for rolling positions, the first `sink_cols` gathered columns are scored against a
// second copy of q (rotated at the query's slot in the StreamingLLM cache), as the dense
// reference path in metronome.model.llama does.
//
// At head sizes 64 and 128, bf16 on AVX512-BF16 runs `attend_task_bf16` (attend_bf16.h), the
// same task 16 keys at a time, and float32 on AVX2 with FMA `attend_task_f32` (attend_f32.h),
// 8 keys at a time; everything else the generic `attend_task`.
//
// Layout: q, q_sink (T, H, D); K/V of one layer (KVH, slots, D) with slot = block * bs + offset;
// block_ids / block_logical (B, MB); out (T, H * D). Compiled by metronome.model.native.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "attend_bf16.h"
#include "attend_common.h"
#include "attend_f32.h"
#include "rope_row.h"

namespace {

using namespace metronome_attend;

// Whether head sizes 64 and 128 run the vectorised tasks where the CPU has them (the
// default) or the generic task everywhere: a switch for benches and tests that compare the
// two in one process (`set_vector_tasks`), never flipped by the engine.
std::atomic<bool> g_vector_tasks{true};

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

// D known at compile time for the common head sizes lets the compiler unroll and vectorise.
template <typename scalar_t, int kD>
void attend_task(const scalar_t* q, const scalar_t* q_sink, const scalar_t* k_base,
                 const scalar_t* v_base, const int64_t* blocks, const int64_t* logical,
                 int64_t num_blocks, int64_t block_size, int64_t position, int64_t window_start,
                 int64_t sink_tokens, int64_t sink_blocks, int group, float scale,
                 scalar_t* out, int64_t d_runtime) {
  const int64_t D = kD > 0 ? kD : d_runtime;
  // the group's queries, scaled, as float (q and its rolling-sink copy)
  alignas(64) float qf[kMaxGroup][kD > 0 ? kD : 256];
  alignas(64) float qs[kMaxGroup][kD > 0 ? kD : 256];
  alignas(64) float acc[kMaxGroup][kD > 0 ? kD : 256];
  alignas(64) float scores[kMaxGroup][kMaxBlock];
  float run_max[kMaxGroup], run_sum[kMaxGroup];
  for (int h = 0; h < group; ++h) {
    for (int64_t d = 0; d < D; ++d) {
      qf[h][d] = as_float(q[h * D + d]) * scale;
      qs[h][d] = q_sink != nullptr ? as_float(q_sink[h * D + d]) * scale : qf[h][d];
      acc[h][d] = 0.f;
    }
    run_max[h] = kMasked;
    run_sum[h] = 0.f;
  }
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t first = logical[i] * block_size;  // absolute position of the block's slot 0
    if (first > position) break;  // logical order: every later block is in the future
    if (first >= sink_tokens && first + block_size <= window_start) {
      continue;  // wholly between the sinks and the window: invisible
    }
    const float(*qq)[kD > 0 ? kD : 256] = i < sink_blocks ? qs : qf;
    const scalar_t* kb = k_base + blocks[i] * block_size * D;
    const scalar_t* vb = v_base + blocks[i] * block_size * D;
    if (i + 1 < num_blocks) {
      // blocks are scattered through the pool, so the hardware prefetcher restarts at each
      // one: ask for the next block's keys and values while this one is scored
      const char* kn = reinterpret_cast<const char*>(k_base + blocks[i + 1] * block_size * D);
      const char* vn = reinterpret_cast<const char*>(v_base + blocks[i + 1] * block_size * D);
      const int64_t bytes = block_size * D * static_cast<int64_t>(sizeof(scalar_t));
      for (int64_t off = 0; off < bytes; off += 64) {
        __builtin_prefetch(kn + off, 0, 3);
        __builtin_prefetch(vn + off, 0, 3);
      }
    }
    for (int64_t j = 0; j < block_size; ++j) {
      const int64_t col = first + j;
      const bool visible = col <= position && (col < sink_tokens || col >= window_start);
      const scalar_t* kr = kb + j * D;
      for (int h = 0; h < group; ++h) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qq[h][d] * as_float(kr[d]);
        scores[h][j] = visible ? dot : kMasked;
      }
    }
    for (int h = 0; h < group; ++h) {
      float block_max = kMasked;
      for (int64_t j = 0; j < block_size; ++j) block_max = std::max(block_max, scores[h][j]);
      if (block_max > run_max[h]) {
        const float rescale = std::exp(run_max[h] - block_max);
        run_sum[h] *= rescale;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[h][d] *= rescale;
        run_max[h] = block_max;
      }
      const float m = run_max[h];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < block_size; ++j) {
        const float p = std::exp(scores[h][j] - m);  // masked: exp(-1e30) = 0
        scores[h][j] = p;
        sum += p;
      }
      run_sum[h] += sum;
    }
    for (int64_t j = 0; j < block_size; ++j) {
      const scalar_t* vr = vb + j * D;
      for (int h = 0; h < group; ++h) {
        const float p = scores[h][j];
        if (p == 0.f) continue;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[h][d] += p * as_float(vr[d]);
      }
    }
  }
  for (int h = 0; h < group; ++h) {
    // every query sees at least its own key, so run_sum > 0
    const float inv = 1.f / run_sum[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<scalar_t>(acc[h][d] * inv);
  }
}


template <typename T>
using VectorTask = void (*)(const T*, const T*, const T*, const T*, const int64_t*,
                            const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int, float, T*);

// The vectorised task for scalar_t at head size D on this CPU, or nullptr (the generic one).
template <typename scalar_t>
VectorTask<scalar_t> vector_task(int64_t D) {
  if (D != 64 && D != 128) return nullptr;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    return D == 64 ? attend_task_bf16<64> : attend_task_bf16<128>;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    return D == 64 ? attend_task_f32<64> : attend_task_f32<128>;
  }
#endif
  return nullptr;
}

template <typename scalar_t>
void paged_attention_typed(const at::Tensor& q, const c10::optional<at::Tensor>& q_sink,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& token_session, const at::Tensor& token_position,
                           const at::Tensor& token_window_start, const at::Tensor& block_ids,
                           const at::Tensor& block_logical, const at::Tensor& num_blocks,
                           const at::Tensor& sink_tokens, const at::Tensor& sink_blocks,
                           int64_t block_size, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), slots = k_cache.size(1);
  const int64_t MB = block_ids.size(1);
  const int group = static_cast<int>(H / KVH);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* qsp = q_sink.has_value() ? q_sink->data_ptr<scalar_t>() : nullptr;
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* ts = token_session.data_ptr<int64_t>();
  const int64_t* tp = token_position.data_ptr<int64_t>();
  const int64_t* tw = token_window_start.data_ptr<int64_t>();
  const int64_t* bid = block_ids.data_ptr<int64_t>();
  const int64_t* blg = block_logical.data_ptr<int64_t>();
  const int64_t* nb = num_blocks.data_ptr<int64_t>();
  const int64_t* st = sink_tokens.data_ptr<int64_t>();
  const int64_t* sb = sink_blocks.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  const VectorTask<scalar_t> fast =
      g_vector_tasks.load(std::memory_order_relaxed) ? vector_task<scalar_t>(D) : nullptr;
  at::parallel_for(0, T * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / KVH, g = task % KVH;
      const int64_t b = ts[t];
      const int64_t q_off = (t * H + g * group) * D;
      if (fast != nullptr) {
        fast(qp + q_off, qsp != nullptr && sb[b] > 0 ? qsp + q_off : nullptr,
             kp + g * slots * D, vp + g * slots * D, bid + b * MB, blg + b * MB, nb[b],
             block_size, tp[t], tw[t], st[b], sb[b], group, fscale, op + q_off);
        continue;
      }
      auto run = [&](auto d_tag) {
        constexpr int kD = decltype(d_tag)::value;
        attend_task<scalar_t, kD>(
            qp + q_off, qsp != nullptr && sb[b] > 0 ? qsp + q_off : nullptr,
            kp + g * slots * D, vp + g * slots * D, bid + b * MB, blg + b * MB, nb[b],
            block_size, tp[t], tw[t], st[b], sb[b], group, fscale, op + q_off, D);
      };
      if (D == 64) run(std::integral_constant<int, 64>{});
      else if (D == 128) run(std::integral_constant<int, 128>{});
      else run(std::integral_constant<int, 0>{});
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "paged_attention: ", what); }

at::Tensor paged_attention(const at::Tensor& q, const c10::optional<at::Tensor>& q_sink,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& token_session, const at::Tensor& token_position,
                           const at::Tensor& token_window_start, const at::Tensor& block_ids,
                           const at::Tensor& block_logical, const at::Tensor& num_blocks,
                           const at::Tensor& sink_tokens, const at::Tensor& sink_blocks,
                           int64_t block_size, double scale) {
  check(q.dim() == 3 && q.is_contiguous(), "q must be contiguous (T, H, D)");
  check(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
            k_cache.sizes() == v_cache.sizes(),
        "K/V must be contiguous (KVH, slots, D) of one shape");
  check(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
        "q and K/V must share a dtype");
  check(k_cache.size(2) == q.size(2), "q and K/V head_dim differ");
  check(q.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of kv heads");
  check(q.size(1) / k_cache.size(0) <= kMaxGroup, "more than 16 query heads per kv head");
  check(q.size(2) <= 256, "head_dim over 256");
  check(block_size >= 1 && block_size <= kMaxBlock, "block_size must be in [1, 256]");
  check(k_cache.size(1) % block_size == 0, "slots must be whole blocks");
  if (q_sink.has_value()) {
    check(q_sink->sizes() == q.sizes() && q_sink->is_contiguous() &&
              q_sink->scalar_type() == q.scalar_type(),
          "q_sink must match q");
  }
  const int64_t T = q.size(0), B = block_ids.size(0);
  for (const at::Tensor* t : {&token_session, &token_position, &token_window_start}) {
    check(t->dim() == 1 && t->size(0) == T && t->scalar_type() == at::kLong && t->is_contiguous(),
          "per-token tensors must be contiguous int64 (T,)");
  }
  for (const at::Tensor* t : {&num_blocks, &sink_tokens, &sink_blocks}) {
    check(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong && t->is_contiguous(),
          "per-session tensors must be contiguous int64 (B,)");
  }
  check(block_ids.dim() == 2 && block_logical.sizes() == block_ids.sizes() &&
            block_ids.scalar_type() == at::kLong && block_logical.scalar_type() == at::kLong &&
            block_ids.is_contiguous() && block_logical.is_contiguous(),
        "block tables must be contiguous int64 (B, max_blocks)");
  // index ranges are checked once per step by the caller (metronome.model.native)
  at::Tensor out = at::empty({T, q.size(1) * q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention",
                                  [&] {
                                    paged_attention_typed<scalar_t>(
                                        q, q_sink, k_cache, v_cache, token_session,
                                        token_position, token_window_start, block_ids,
                                        block_logical, num_blocks, sink_tokens, sink_blocks,
                                        block_size, scale, out);
                                  });
  return out;
}

// A paged step's attention from its fused q/k/v projection in one call (the decode path's
// Python per layer was ~10 torch calls around the kernel): RoPE on q and k (`rope_row`, as
// the fused `rope` rounds it), k and v written to their slots, then `paged_attention` over
// the rotated q. qkv (T, (H + 2 KVH) D) with unit stride in its last dim (q heads, then k,
// then v); cos/sin (T, 1, D) contiguous; slot_ids (T,) int64.
at::Tensor rope_write_attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_ids,
                             int64_t num_heads, const at::Tensor& token_session,
                             const at::Tensor& token_position,
                             const at::Tensor& token_window_start, const at::Tensor& block_ids,
                             const at::Tensor& block_logical, const at::Tensor& num_blocks,
                             const at::Tensor& sink_tokens, const at::Tensor& sink_blocks,
                             int64_t block_size, double scale) {
  check(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
            k_cache.sizes() == v_cache.sizes(),
        "K/V must be contiguous (KVH, slots, D) of one shape");
  const int64_t T = qkv.size(0), KVH = k_cache.size(0), slots = k_cache.size(1);
  const int64_t D = k_cache.size(2), H = num_heads;
  check(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * KVH) * D,
        "qkv must be (T, (heads + 2 kv heads) head_dim) with unit stride in its last dim");
  check(qkv.scalar_type() == k_cache.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
            sin.scalar_type() == qkv.scalar_type(),
        "qkv, cos, sin and K/V must share a dtype");
  check(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D &&
            sin.numel() == T * D, "cos and sin must be contiguous (T, 1, head_dim)");
  check(slot_ids.dim() == 1 && slot_ids.size(0) == T && slot_ids.scalar_type() == at::kLong &&
            slot_ids.is_contiguous(), "slot_ids must be contiguous int64 (T,)");
  check(D % 2 == 0, "head_dim must be even");
  const int64_t* slot = slot_ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) check(slot[t] >= 0 && slot[t] < slots, "slot id out of range");
  at::Tensor q_rot = at::empty({T, H, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write", [&] {
    const scalar_t* x = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* qp = q_rot.data_ptr<scalar_t>();
    scalar_t* kp = k_cache.data_ptr<scalar_t>();
    scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int64_t stride = qkv.stride(0);
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = x + t * stride;
        const scalar_t* c = cp + t * D;
        const scalar_t* s = sp + t * D;
        for (int64_t h = 0; h < H; ++h) rope_row(row + h * D, c, s, qp + (t * H + h) * D, D);
        for (int64_t g = 0; g < KVH; ++g) {
          const int64_t to = (g * slots + slot[t]) * D;
          rope_row(row + (H + g) * D, c, s, kp + to, D);
          std::copy(row + (H + KVH + g) * D, row + (H + KVH + g + 1) * D, vp + to);
        }
      }
    });
  });
  return paged_attention(q_rot, c10::nullopt, k_cache, v_cache, token_session, token_position,
                         token_window_start, block_ids, block_logical, num_blocks, sink_tokens,
                         sink_blocks, block_size, scale);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // both without the GIL, as torch's own ops run: the server's event loop must not wait for
  // a layer's attention on the engine's thread
  m.def("paged_attention", &paged_attention,
        "Attention of each query token over its session's resident KV blocks, in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_write_attend", &rope_write_attend,
        "RoPE on q and k, k and v into their slots, then paged_attention: a paged step's "
        "attention from its fused qkv",
        py::call_guard<py::gil_scoped_release>());
  m.def("set_vector_tasks", [](bool enabled) { g_vector_tasks.store(enabled); },
        "Run the vectorised attention tasks where they apply (True, the default) or the "
        "generic task everywhere (False): for benches and tests comparing the two");
  m.def("set_bf16_far_prefetch", [](bool enabled) { g_bf16_far_prefetch.store(enabled); },
        "Whether the bf16 task also prefetches the block after next (True, the build's "
        "default) or the next block only; `native.kernel()` sets it by CPU vendor");
  m.def("bf16_far_prefetch", [] { return g_bf16_far_prefetch.load(); },
        "Whether the bf16 task prefetches the block after next");
  m.def("vector_tasks", [] { return g_vector_tasks.load(); },
        "Whether the vectorised attention tasks run where they apply");
  m.def("vector_task_dtypes", [] {
    std::vector<std::string> dtypes;
#if defined(__AVX512BF16__)
    dtypes.push_back("bfloat16");
#endif
#if defined(__AVX2__) && defined(__FMA__)
    dtypes.push_back("float32");
#endif
    return dtypes;
  }, "The K/V dtypes with a vectorised task on this CPU (head sizes 64 and 128)");
}
