// e^x on float32 lanes for x <= 0 (a score minus its row's max), shared by the kernels in
// this directory: 16 lanes on AVX512, 8 on AVX2 with FMA. 2^(x log2 e) split into 2^n 2^f,
// |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative error ~1e-7: float32's own
// rounding); lanes below -87 (a masked score minus the max) are 0.
#pragma once

#include <immintrin.h>

#if defined(__AVX512F__)
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same polynomial on 8 lanes; 2^n built in the exponent bits (n >= -126 after the clamp,
// so 2^n is a normal float).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif
