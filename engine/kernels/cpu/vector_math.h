// Vector helpers shared by the kernels: the same lanes in give the same bits out on every
// build, unlike libm calls whose vectorization the compiler chooses.

#pragma once

#include "intrinsics.h"
#include <math.h>
#include <stdint.h>

namespace sluice {

// exp for a vector, Cephes' single-precision polynomial (about 1 ulp); inputs below -87.3 give
// 2^-126, not 0.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.72283f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 2^t for t in [-125, 0], within 1 ulp: cheaper than exp256 (seven multiplies or FMAs against
// twelve, no round or convert instruction), for the sampler's pass over a row's weights.
// t = 0 gives exactly 1. Outside that range the result is garbage, so callers mask.
inline __m256 exp2_256_nonpositive(__m256 t) {
  // Adding 1.5 x 2^23 rounds t to an integer n held in the sum's low mantissa bits.
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 shifted = _mm256_add_ps(t, magic);
  const __m256 f = _mm256_sub_ps(t, _mm256_sub_ps(shifted, magic));
  // 2^f for f in [-0.5, 0.5]: a degree-6 minimax fit of the relative error (2e-9) with 1 exact.
  __m256 p = _mm256_set1_ps(1.5353361959569156e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398875016719103e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.61843691766262e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5503323674201965e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022647738456726e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931471824645996e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  // Times 2^n by adding n to the exponent field: the sum's bits shifted by 23 are n << 23 (mod
  // 2^32), and p's exponent (-1 or 0) stays a normal one for n >= -125.
  const __m256i scale = _mm256_slli_epi32(_mm256_castps_si256(shifted), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), scale));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float row_max(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(x + i));
  float m = hmax(best);
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace sluice
