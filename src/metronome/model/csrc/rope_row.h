// Rotate-half RoPE of one head's row, rounded as metronome.model.rope.apply rounds it in the
// row's dtype: round(round(x * cos) + round(rotate_half(x) * sin)), rotate_half(x) =
// (-x[D/2:], x[:D/2]) (the negation is exact in any dtype). Shared by the fused elementwise
// kernels (`rope`) and the paged kernel's decode entry (`rope_write_attend`), so the two
// give the same bits.
#pragma once

#include <cstdint>

template <typename scalar_t>
inline void rope_row(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, scalar_t* out,
                     int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) {
    const float rot = i < half ? -static_cast<float>(x[i + half])
                               : static_cast<float>(x[i - half]);
    const float a = static_cast<float>(
        static_cast<scalar_t>(static_cast<float>(x[i]) * static_cast<float>(cos[i])));
    const float b = static_cast<float>(static_cast<scalar_t>(rot * static_cast<float>(sin[i])));
    out[i] = static_cast<scalar_t>(a + b);
  }
}
