// What the paged kernel's attention tasks share (csrc/paged_attention.cpp and the vectorised
// tasks it dispatches to, attend_bf16.h and attend_f32.h).
#pragma once

#include <atomic>
#include <cstdint>

namespace metronome_attend {

constexpr float kMasked = -1.0e30f;  // finite: the build uses -ffast-math (no infinities)
constexpr int kMaxGroup = 16;
constexpr int kMaxBlock = 256;

// the first byte of a block's rows of K or V (kD values each)
template <int kD, typename T>
inline const char* block_bytes(const T* base, int64_t block, int64_t block_size) {
  return reinterpret_cast<const char*>(base + block * block_size * kD);
}

// ask for the cache lines of bytes [begin, end) of `p` into L2 (prefetcht2)
inline void prefetch_l2(const char* p, int64_t begin, int64_t end) {
  for (int64_t off = begin; off < end; off += 64) __builtin_prefetch(p + off, 0, 1);
}

// Whether the bf16 task also asks for the block after next (`attend_task_bf16`): it pays on
// one CPU and costs on another, so the Python side sets it by vendor at load
// (`native.far_prefetch_pays`); it never changes a result. An inline variable: builds loaded
// into one process share one (the dynamic linker unifies it), so two builds A/B'd side by
// side (`scripts/attention_ab.py`) must differ in code, not in this default.
inline std::atomic<bool> g_bf16_far_prefetch{true};

}  // namespace metronome_attend
