// Sinks+window attention over vLLM's CPU KV cache, read in place: no gather, no mask tensor.
//
// The rule (metronome.vllm.config): a query at absolute position p sees key j iff
//     j <= p  and  (j < S  or  p - j < W).
// One task = (request, a tile of up to 8 of its query tokens, kv head). A task
// visits only the blocks some query of its tile can see: the sink blocks [0, ceil(S / bs))
// and the window blocks from the tile's first window position to its last query. Freed gap
// blocks are never touched (their table entries may be vLLM's null block, or stale ids of
// blocks another request now owns). Each visited block's keys and values are scored for
// every (token, head) row of the tile by register-tiled loops, read in place for decode
// tiles (and any float cache), or first converted once into float scratch (keys dim-major)
// for chunk tiles of a 16-bit cache, and folded into a running softmax per row in float32.
// Slots past the tile's last query (unwritten, maybe NaN) never reach a sum: the softmax
// and the values loop stop before them, and a masked column's probability is exactly 0.
//
// Cache: one layer's kv_cache, contiguous (num_blocks, kv_heads, block_size, 2 * D); the
// (block, head) region is block_size * D key cells then block_size * D value cells, in one of
// three layouts, as the caller says (metronome.vllm.kernel checks it against vLLM's own cache
// writer): values slot-major with keys dim-major (vLLM's "vec"/"vec16" writers) or
// slot-major; or the "amx" writer's tiles of VNNI pairs (bf16 on a CPU with AMX):
// key[c][d] at (c / 16) * 16 * D + (d / 2) * 32 + (c % 16) * 2 + d % 2 (tiles of 16 slots),
// value[c][d] at (d / 16) * 16 * bs + (c / 2) * 32 + (d % 16) * 2 + c % 2 (tiles of 16
// dims): the VNNI pairs AVX512-BF16's dot product reads as they lie, so a bf16 cache there is
// read in place (queries and probabilities as bf16 pairs, sums in float32, as vLLM's own AMX
// kernel does); without AVX512-BF16 the blocks are converted to float scratch first.
// Compiled by metronome.vllm.kernel (metronome.model.native's build cache).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr float kMasked = -1.0e30f;  // finite: the build uses -ffast-math (no infinities)
constexpr int kMaxGroup = 16;
constexpr int kMaxRows = 48;         // rows of a task: tile tokens x query heads of a group
constexpr int kMaxBlock = 256;
constexpr int kMaxD = 256;
constexpr int kLanes = 16;           // slot / dim tile of the inner loops (2 ymm, 1 zmm)
constexpr int kRowTile = 4;          // rows per register tile

// How a (block, head) region is laid out (the caller's `layout` argument).
enum Layout : int64_t { kKeysSlotMajor = 0, kKeysDimMajor = 1, kAmxTiles = 2 };
constexpr int kAmxRows = 16;        // rows of an AMX tile register (kMaxRows is a multiple)

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

struct Task {
  int64_t request, token_begin, token_end, kv_head, first_position;
  int64_t cost;  // tokens x blocks visited: what the task reads and computes, roughly
};

// Per-thread scratch, packed at the step's D and block size (so a block's float copy stays
// in L1/L2 whatever the maxima): row r of q/acc at r * D, of s at r * bs; kt[d * bs + c];
// v[c * D + d].
struct Scratch {
  alignas(64) float q[kMaxRows * kMaxD];     // scaled queries
  alignas(64) float acc[kMaxRows * kMaxD];   // running weighted values
  alignas(64) float s[kMaxRows * kMaxBlock]; // scores, then probabilities, of one block
  alignas(64) float kt[kMaxD * kMaxBlock];   // one block's keys, dim-major, float
  alignas(64) float v[kMaxBlock * kMaxD];    // one block's values, slot-major, float
  float run_max[kMaxRows], run_sum[kMaxRows];
  int64_t position[kMaxRows];
  // AMX layout, bf16: queries (unscaled) and one block's probabilities as bf16 rows, what
  // a tile product loads and, read two at a time, the pairs a dpbf16 broadcasts
  alignas(64) uint16_t qb[kMaxRows * kMaxD];
  alignas(64) uint16_t pb[kMaxRows * kMaxBlock];
  alignas(64) float tile[kAmxRows * kLanes];
};

// the bf16 pair (row[0], row[1]) as one 32-bit lane, row[0] in its low half
inline int bf16_pair_at(const uint16_t* row) {
  int pair;
  std::memcpy(&pair, row, sizeof pair);
  return pair;
}

#if defined(__AVX512BF16__)
constexpr bool kDpbf16 = true;

// n floats (a multiple of 16) to bf16, rounded to nearest even, 16 at a time
inline void to_bf16(const float* from, uint16_t* to, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(from + i)));
}

// AMX tiles, bf16: s[r][c] = scale * q[r] . k[c] for R rows from r0, every block column.
// A key tile of 16 slots holds, per dim pair p, 16 x (k[c][2p], k[c][2p+1]): one dpbf16
// against the row's broadcast pair (q[2p], q[2p+1]) adds both products to 16 lanes.
template <int R>
inline void scores_amx(Scratch& w, int r0, int64_t D, int64_t bs, const uint16_t* keys,
                       float scale) {
  const int64_t pairs = D / 2;
  for (int64_t c0 = 0; c0 < bs; c0 += kLanes) {
    const uint16_t* tile = keys + c0 * D;
    __m512 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(tile + p * 2 * kLanes);
      for (int r = 0; r < R; ++r)
        a[r] = _mm512_dpbf16_ps(
            a[r], k, (__m512bh)_mm512_set1_epi32(bf16_pair_at(&w.qb[(r0 + r) * D + 2 * p])));
    }
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(&w.s[(r0 + r) * bs + c0], _mm512_mul_ps(a[r], _mm512_set1_ps(scale)));
  }
}

// AMX tiles, bf16: acc[r] += sum over the first `pairs` slot pairs of p[r][c] * v[c]. A value
// tile of 16 dims holds, per slot pair, 16 x (v[2sp][d], v[2sp + 1][d]).
template <int R>
inline void values_amx(Scratch& w, int r0, int64_t D, int64_t bs, int64_t pairs,
                       const uint16_t* values) {
  for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
    const uint16_t* tile = values + d0 * bs;
    __m512 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_loadu_ps(&w.acc[(r0 + r) * D + d0]);
    for (int64_t sp = 0; sp < pairs; ++sp) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(tile + sp * 2 * kLanes);
      for (int r = 0; r < R; ++r)
        a[r] = _mm512_dpbf16_ps(
            a[r], v, (__m512bh)_mm512_set1_epi32(bf16_pair_at(&w.pb[(r0 + r) * bs + 2 * sp])));
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(&w.acc[(r0 + r) * D + d0], a[r]);
  }
}
#else
constexpr bool kDpbf16 = false;
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Tile registers: 0 = a product (16 rows x 16 float32), 1 = 16 rows of 32 bf16 (queries or
// probabilities), 2 = 16 rows of 16 bf16 pairs (keys or values, as the cache holds them).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64};
  uint8_t rows[16] = {kAmxRows, kAmxRows, kAmxRows};
};

// Linux gives a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); without it a tile instruction is SIGILL. Asked once.
inline bool amx_usable() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Tile 0 = A . B over `depth` (a multiple of 32): A is 16 rows of bf16 at `a` (row stride
// `a_stride_bytes`), B the cache's pairs at `b`, 16 lanes x 2 a row, 32 rows per 32 of depth.
inline void tile_product(const uint16_t* a, int a_stride_bytes, const uint16_t* b,
                         int64_t depth) {
  _tile_zero(0);
  for (int64_t k0 = 0; k0 < depth; k0 += 32) {
    _tile_loadd(1, a + k0, a_stride_bytes);
    _tile_loadd(2, b + k0 * kLanes, 64);  // pairs k0/2 .. k0/2 + 15
    _tile_dpbf16ps(0, 1, 2);
  }
}

// s[r][c] = scale * q[r] . k[c] for the 16 rows from r0 (rows past the task's are scratch),
// every block column: tiles of 16 slots, 32 dims a product.
inline void scores_amx_tiles(Scratch& w, int r0, int64_t D, int64_t bs, const uint16_t* keys,
                             float scale) {
  for (int64_t c0 = 0; c0 < bs; c0 += kLanes) {  // a tile of 16 slots, dims in pairs
    tile_product(&w.qb[r0 * D], static_cast<int>(D * 2), keys + c0 * D, D);
    _tile_stored(0, &w.s[r0 * bs + c0], static_cast<int>(bs * 4));
  }
  for (int r = r0; r < r0 + kAmxRows; ++r)
#pragma omp simd
    for (int64_t c = 0; c < bs; ++c) w.s[r * bs + c] *= scale;
}

// acc[r] += p[r] . v for the 16 rows from r0 over a whole block (every slot written): tiles
// of 16 dims, 32 slots a product.
inline void values_amx_tiles(Scratch& w, int r0, int rows, int64_t D, int64_t bs,
                             const uint16_t* values) {
  for (int64_t d0 = 0; d0 < D; d0 += kLanes) {  // a tile of 16 dims, slots in pairs
    tile_product(&w.pb[r0 * bs], static_cast<int>(bs * 2), values + d0 * bs, bs);
    _tile_stored(0, w.tile, kLanes * 4);
    for (int r = 0; r < std::min(kAmxRows, rows - r0); ++r)
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) w.acc[(r0 + r) * D + d0 + l] += w.tile[r * kLanes + l];
  }
}
#endif

// s[r][c] = q[r] . k[c] for R rows starting at r0, all block columns (bs a multiple of
// kLanes); keys dim-major at kt[d * bs + c], float scratch or the cache itself
template <int R, typename K>
inline void scores_tile(Scratch& w, int r0, int64_t D, int64_t bs, const K* kt) {
  for (int64_t c0 = 0; c0 < bs; c0 += kLanes) {
    float a[R][kLanes] = {};
    for (int64_t d = 0; d < D; ++d) {
      const K* kd = kt + d * bs + c0;
      for (int r = 0; r < R; ++r) {
        const float qd = w.q[(r0 + r) * D + d];
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) a[r][l] += qd * as_float(kd[l]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) w.s[(r0 + r) * bs + c0 + l] = a[r][l];
  }
}

// acc[r] += sum_c p[r][c] * v[c] for R rows starting at r0, columns [0, ncols); values
// slot-major at v[c * D + d], float scratch or the cache itself
template <int R, typename V>
inline void values_tile(Scratch& w, int r0, int64_t D, int64_t bs, int64_t ncols, const V* v) {
  for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
    float a[R][kLanes];
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) a[r][l] = w.acc[(r0 + r) * D + d0 + l];
    for (int64_t c = 0; c < ncols; ++c) {
      const V* vc = v + c * D + d0;
      for (int r = 0; r < R; ++r) {
        const float p = w.s[(r0 + r) * bs + c];
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) a[r][l] += p * as_float(vc[l]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) w.acc[(r0 + r) * D + d0 + l] = a[r][l];
  }
}

template <typename Fn>
inline void over_row_tiles(int rows, Fn&& fn) {
  int r0 = 0;
  for (; r0 + kRowTile <= rows; r0 += kRowTile) fn(std::integral_constant<int, kRowTile>{}, r0);
  switch (rows - r0) {
    case 3: fn(std::integral_constant<int, 3>{}, r0); break;
    case 2: fn(std::integral_constant<int, 2>{}, r0); break;
    case 1: fn(std::integral_constant<int, 1>{}, r0); break;
    default: break;
  }
}

struct Geometry {
  int64_t H, KVH, D, bs, block_stride, head_stride, max_blocks, sinks, window, sink_blocks;
  int group;
  Layout layout;
  bool amx;  // AMX tile registers serve the chunk tiles (see amx_usable)
  float scale;
};

// The logical blocks a task visits: sink blocks, then window blocks (never both for one).
inline void visited_blocks(const Geometry& g, int64_t first_position, int64_t last_position,
                           std::vector<int64_t>& out) {
  out.clear();
  const int64_t last_block = last_position / g.bs;
  const int64_t sink_end = std::min(g.sink_blocks, last_block + 1);
  for (int64_t b = 0; b < sink_end; ++b) out.push_back(b);
  const int64_t window_first = std::max(g.sinks, first_position - g.window + 1);
  for (int64_t b = std::max(g.sink_blocks, window_first / g.bs); b <= last_block; ++b)
    out.push_back(b);
}

template <typename scalar_t>
void run_task(const Task& t, const Geometry& g, const scalar_t* q, const scalar_t* cache,
              const int32_t* block_table, scalar_t* out, Scratch& w,
              std::vector<int64_t>& blocks) {
  const int64_t D = g.D, bs = g.bs;
  // AMX tiles of a bf16 cache with AVX512-BF16: dot products on the pairs as they lie
  constexpr bool is_bf16 = std::is_same<scalar_t, c10::BFloat16>::value;
  const bool in_place_pairs = kDpbf16 && is_bf16 && g.layout == kAmxTiles;
  const int tokens = static_cast<int>(t.token_end - t.token_begin);
  const int rows = tokens * g.group;
  for (int i = 0; i < tokens; ++i) {
    const scalar_t* qt = q + ((t.token_begin + i) * g.H + t.kv_head * g.group) * D;
    for (int h = 0; h < g.group; ++h) {
      const int r = i * g.group + h;
      for (int64_t d = 0; d < D; ++d) {
        w.q[r * D + d] = as_float(qt[h * D + d]) * g.scale;
        w.acc[r * D + d] = 0.f;
      }
      w.run_max[r] = kMasked;
      w.run_sum[r] = 0.f;
      w.position[r] = t.first_position + i;
      if (in_place_pairs) {
        for (int64_t d = 0; d < D; ++d) w.qb[r * D + d] = c10::BFloat16(as_float(qt[h * D + d])).x;
      }
    }
  }
  // AMX tile registers for chunk tiles (decode rows are few: AVX512-BF16 serves them)
  const bool tiles = in_place_pairs && g.amx && rows > kRowTile;
  if (tiles) {  // rows past the task's are read by the last product: zeros, not stale data
    const int padded = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
    std::fill(&w.qb[rows * D], &w.qb[padded * D], uint16_t{0});
  }
  const int64_t last_position = t.first_position + tokens - 1;
  visited_blocks(g, t.first_position, last_position, blocks);
  const int32_t* table = block_table + t.request * g.max_blocks;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t logical = blocks[i];
    const scalar_t* region = cache + table[logical] * g.block_stride + t.kv_head * g.head_stride;
    if (i + 1 < blocks.size()) {
      // blocks are scattered through the pool, which is far larger than the caches: fetch
      // the next region while this one is used (with everything cached, as in a kernel-only
      // timing, the loop costs ~9 % of a chunk's kernel time; in a step it pays)
      const char* next = reinterpret_cast<const char*>(
          cache + table[blocks[i + 1]] * g.block_stride + t.kv_head * g.head_stride);
      const int64_t bytes = g.head_stride * static_cast<int64_t>(sizeof(scalar_t));
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + off, 0, 3);
    }
    const int64_t first = logical * bs;
    const int64_t ncols = std::min(bs, last_position + 1 - first);  // later slots: unwritten
    const scalar_t* keys = region;
    const scalar_t* values = region + bs * D;
    // Few rows (decode) or float: read the cache in place. Columns past ncols may hold
    // garbage; their scores are never used (the softmax and the values loop stop at ncols).
    const bool direct = g.layout == kKeysDimMajor && (std::is_same<scalar_t, float>::value ||
                                                      rows <= kRowTile);
    if (direct || in_place_pairs) {
      // nothing to convert
    } else if (g.layout == kAmxTiles) {
      // keys: tiles of 16 slots, each pairs of dims x 16 slots x 2, read in storage order
      // (slots past ncols are read too, unwritten: their scores are never used)
      for (int64_t c0 = 0; c0 < bs; c0 += kLanes) {
        const scalar_t* tile = keys + c0 * D;
        for (int64_t d = 0; d < D; d += 2) {
          const scalar_t* pair = tile + d * kLanes;  // (d / 2) * 32
          float* even = &w.kt[d * bs + c0];
          float* odd = &w.kt[(d + 1) * bs + c0];
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) {
            even[l] = c0 + l < ncols ? as_float(pair[2 * l]) : 0.f;
            odd[l] = c0 + l < ncols ? as_float(pair[2 * l + 1]) : 0.f;
          }
        }
      }
    } else if (g.layout == kKeysDimMajor) {
      for (int64_t d = 0; d < D; ++d) {
#pragma omp simd
        for (int64_t c = 0; c < ncols; ++c) w.kt[d * bs + c] = as_float(keys[d * bs + c]);
        for (int64_t c = ncols; c < bs; ++c) w.kt[d * bs + c] = 0.f;
      }
    } else {
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t c = 0; c < ncols; ++c) w.kt[d * bs + c] = as_float(keys[c * D + d]);
        for (int64_t c = ncols; c < bs; ++c) w.kt[d * bs + c] = 0.f;
      }
    }
    if (in_place_pairs) {
      // read in place below
    } else if (g.layout == kAmxTiles) {
      // values: tiles of 16 dims, each pairs of slots x 16 dims x 2
      for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
        const scalar_t* tile = values + d0 * bs;
        for (int64_t c = 0; c < ncols; ++c) {
          const scalar_t* pair = tile + (c / 2) * 2 * kLanes + c % 2;
          float* vc = &w.v[c * D + d0];
#pragma omp simd
          for (int l = 0; l < kLanes; ++l) vc[l] = as_float(pair[2 * l]);
        }
      }
    } else if (!direct) {
      for (int64_t c = 0; c < ncols; ++c) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) w.v[c * D + d] = as_float(values[c * D + d]);
      }
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles) {
      for (int r0 = 0; r0 < rows; r0 += kAmxRows)
        scores_amx_tiles(w, r0, D, bs, reinterpret_cast<const uint16_t*>(keys), g.scale);
    }
#endif
    if (!tiles) over_row_tiles(rows, [&](auto r_tag, int r0) {
#if defined(__AVX512BF16__)
      if (in_place_pairs) {
        scores_amx<decltype(r_tag)::value>(w, r0, D, bs,
                                           reinterpret_cast<const uint16_t*>(keys), g.scale);
        return;
      }
#endif
      if (direct) scores_tile<decltype(r_tag)::value>(w, r0, D, bs, keys);
      else scores_tile<decltype(r_tag)::value>(w, r0, D, bs, static_cast<const float*>(w.kt));
    });
    for (int r = 0; r < rows; ++r) {
      // Visible columns of this row: c < n (j <= p), minus the gap [gap_begin, gap_end)
      // (S <= j <= p - W); as ranges, so the loops below vectorize.
      const int64_t p = w.position[r];
      float* sr = &w.s[r * bs];
      float* ar = &w.acc[r * D];
      const int64_t n = std::min(ncols, p - first + 1);
      const int64_t gap_begin = std::max<int64_t>(0, g.sinks - first);
      const int64_t gap_end = std::min(n, p - g.window + 1 - first);
      for (int64_t c = gap_begin; c < gap_end; ++c) sr[c] = kMasked;
      float block_max = kMasked;
      if (n > 0) {
#if defined(__AVX512F__)
        __m512 lanes = _mm512_set1_ps(kMasked);
        for (int64_t c = 0; c < n; c += kLanes) {
          const __mmask16 valid = c + kLanes <= n ? 0xffff : (1u << (n - c)) - 1;
          lanes = _mm512_mask_max_ps(lanes, valid, lanes, _mm512_maskz_loadu_ps(valid, sr + c));
        }
        block_max = _mm512_reduce_max_ps(lanes);
#else
        for (int64_t c = 0; c < n; ++c) block_max = std::max(block_max, sr[c]);
#endif
      }
      if (block_max == kMasked) {  // nothing of this block is visible to this row
        for (int64_t c = 0; c < ncols; ++c) sr[c] = 0.f;
        continue;
      }
      if (block_max > w.run_max[r]) {
        const float rescale = std::exp(w.run_max[r] - block_max);  // exp(-huge) = 0 at first
        w.run_sum[r] *= rescale;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= rescale;
        w.run_max[r] = block_max;
      }
      const float m = w.run_max[r];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < n; ++c) {
        const float e = sr[c] == kMasked ? 0.f : std::exp(sr[c] - m);
        sr[c] = e;
        sum += e;
      }
      for (int64_t c = n; c < ncols; ++c) sr[c] = 0.f;  // past the row's own position
      w.run_sum[r] += sum;
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (tiles && ncols == bs) {  // a whole block: every slot a product reads is written
      for (int r = 0; r < rows; ++r)
        to_bf16(&w.s[r * bs], &w.pb[r * bs], bs);
      for (int r0 = 0; r0 < rows; r0 += kAmxRows)
        values_amx_tiles(w, r0, rows, D, bs, reinterpret_cast<const uint16_t*>(values));
      continue;
    }
#endif
#if defined(__AVX512BF16__)
    if (in_place_pairs) {
      // probabilities as bf16 pairs of whole slot pairs; a last odd slot (its partner is
      // unwritten, maybe NaN: never multiplied) is added in float32 on its own
      const int64_t pairs = ncols / 2;
      for (int r = 0; r < rows; ++r)  // pairs in memory order: (p[2sp], p[2sp + 1])
        to_bf16(&w.s[r * bs], &w.pb[r * bs], bs);
      const uint16_t* vbits = reinterpret_cast<const uint16_t*>(values);
      over_row_tiles(rows, [&](auto r_tag, int r0) {
        values_amx<decltype(r_tag)::value>(w, r0, D, bs, pairs, vbits);
      });
      if (ncols % 2) {
        const int64_t c = ncols - 1;
        for (int r = 0; r < rows; ++r) {
          const float p = w.s[r * bs + c];
          for (int64_t d = 0; d < D; ++d)
            w.acc[r * D + d] +=
                p * as_float(values[(d / kLanes) * kLanes * bs + (c / 2) * 2 * kLanes +
                                    (d % kLanes) * 2 + c % 2]);
        }
      }
      continue;
    }
#endif
    over_row_tiles(rows, [&](auto r_tag, int r0) {
      if (direct) values_tile<decltype(r_tag)::value>(w, r0, D, bs, ncols, values);
      else values_tile<decltype(r_tag)::value>(w, r0, D, bs, ncols, static_cast<const float*>(w.v));
    });
  }
  for (int i = 0; i < tokens; ++i) {
    scalar_t* ot = out + ((t.token_begin + i) * g.H + t.kv_head * g.group) * D;
    for (int h = 0; h < g.group; ++h) {
      const int r = i * g.group + h;
      const float inv = 1.f / w.run_sum[r];  // every query sees at least its own key
      for (int64_t d = 0; d < D; ++d)
        ot[h * D + d] = static_cast<scalar_t>(w.acc[r * D + d] * inv);
    }
  }
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "sinks_window_attention: ", what); }

void sinks_window_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                            const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                            const at::Tensor& block_table, int64_t sink_tokens,
                            int64_t window_tokens, double scale, int64_t layout,
                            int64_t null_block, at::Tensor& output) {
  check(query.dim() == 3 && query.is_contiguous(), "query must be contiguous (T, H, D)");
  check(output.sizes() == query.sizes() && output.is_contiguous() &&
            output.scalar_type() == query.scalar_type(),
        "output must be contiguous and match query");
  check(kv_cache.dim() == 4 && kv_cache.is_contiguous(),
        "kv_cache must be contiguous (num_blocks, kv_heads, block_size, 2 * D)");
  check(kv_cache.scalar_type() == query.scalar_type(), "query and kv_cache must share a dtype");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t NB = kv_cache.size(0), KVH = kv_cache.size(1), bs = kv_cache.size(2);
  check(kv_cache.size(3) == 2 * D, "kv_cache's last dim must be 2 * head_size");
  check(H % KVH == 0 && H / KVH <= kMaxGroup, "query heads must be 1..16 per kv head");
  check(D % kLanes == 0 && D <= kMaxD, "head_size must be a multiple of 16, at most 256");
  check(bs % kLanes == 0 && bs <= kMaxBlock, "block_size must be a multiple of 16, at most 256");
  check(sink_tokens >= 0 && window_tokens >= 1, "need sink_tokens >= 0 and window_tokens >= 1");
  check(layout == kKeysSlotMajor || layout == kKeysDimMajor || layout == kAmxTiles,
        "layout must be 0 (keys slot-major), 1 (keys dim-major) or 2 (AMX tiles)");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_table}) {
    check(t->scalar_type() == at::kInt && t->is_contiguous(),
          "query_start_loc, seq_lens and block_table must be contiguous int32");
  }
  const int64_t R = seq_lens.size(0);
  check(query_start_loc.dim() == 1 && query_start_loc.size(0) >= R + 1,
        "query_start_loc needs num_reqs + 1 entries");
  check(block_table.dim() == 2 && block_table.size(0) >= R, "block_table needs a row per request");

  Geometry g;
  g.H = H; g.KVH = KVH; g.D = D; g.bs = bs;
  g.head_stride = 2 * bs * D;
  g.block_stride = KVH * g.head_stride;
  g.max_blocks = block_table.size(1);
  g.sinks = sink_tokens;
  g.window = window_tokens;
  g.sink_blocks = (sink_tokens + bs - 1) / bs;
  g.group = static_cast<int>(H / KVH);
  g.layout = static_cast<Layout>(layout);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  g.amx = layout == kAmxTiles && query.scalar_type() == at::kBFloat16 && amx_usable();
#else
  g.amx = false;
#endif
  g.scale = static_cast<float>(scale);
  // Up to 8 tokens a tile (24 rows at SmolLM2's group of 3): a 16-token chunk makes two
  // tiles per kv head, so a streaming step's few chunks spread over the threads. With AMX
  // tiles, as many tokens as 48 rows hold (16 at a group of 3): whole 16-row products, and
  // each block read once per chunk.
  const int64_t tile_tokens = std::max<int64_t>(
      1, std::min<int64_t>(g.amx ? kMaxRows : 8, kMaxRows / g.group));

  // Tasks, and every block any of them reads checked once: in the table, in the pool, and
  // not the null block (a visible key there would mean the manager freed a live block).
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  std::vector<Task> tasks;
  std::vector<int64_t> blocks;
  check(qsl[0] == 0 && qsl[R] == T, "query_start_loc must span the query tokens");
  for (int64_t r = 0; r < R; ++r) {
    const int64_t begin = qsl[r], end = qsl[r + 1], seq_len = lens[r];
    check(begin <= end && end - begin <= seq_len, "a request has more queries than tokens");
    for (int64_t t0 = begin; t0 < end; t0 += tile_tokens) {
      const int64_t t1 = std::min(end, t0 + tile_tokens);
      const int64_t first_position = seq_len - (end - begin) + (t0 - begin);
      visited_blocks(g, first_position, first_position + (t1 - t0) - 1, blocks);
      for (int64_t b : blocks) {
        check(b < g.max_blocks, "a visible position lies past the request's block table");
        const int64_t id = table[r * g.max_blocks + b];
        check(id >= 0 && id < NB, "a block id lies outside the KV cache");
        TORCH_CHECK(id != null_block, "sinks_window_attention: request ", r, " sees logical ",
                    "block ", b, ", which is the null block: a freed block is still visible");
      }
      const int64_t cost = (t1 - t0) * static_cast<int64_t>(blocks.size());
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({r, t0, t1, h, first_position, cost});
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, query.scalar_type(), "sinks_window_attention", [&] {
        const scalar_t* qp = query.data_ptr<scalar_t>();
        const scalar_t* cp = kv_cache.data_ptr<scalar_t>();
        scalar_t* op = output.data_ptr<scalar_t>();
        // Costliest first, pulled one by one by every thread: a static split of the list
        // would hand one thread all the chunk tasks of a mixed step and the other the
        // decode rows (measured: 1.6-1.7x vLLM's kernel on such steps before this).
        std::stable_sort(tasks.begin(), tasks.end(),
                         [](const Task& a, const Task& b) { return a.cost > b.cost; });
        std::atomic<int64_t> next{0};
        const int64_t num_tasks = static_cast<int64_t>(tasks.size());
        const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
        at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
          // one scratch per thread for the process's life: a fresh ~0.6 MB allocation
          // per call would page-fault every step
          thread_local std::unique_ptr<Scratch> w(new Scratch);
          thread_local std::vector<int64_t> visited;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
          // every call: another library (oneDNN, vLLM's kernel) may have used the tiles
          static const TileConfig config;
          if (g.amx) _tile_loadconfig(&config);
#endif
          for (int64_t worker = begin; worker < end; ++worker) {
            for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1))
              run_task<scalar_t>(tasks[i], g, qp, cp, table, op, *w, visited);
          }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
          if (g.amx) _tile_release();
#endif
        });
      });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sinks_window_attention", &sinks_window_attention,
        "Sinks+window attention of every query token over vLLM's CPU KV cache, in place");
}
