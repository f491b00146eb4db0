// torch's float32 CPU arithmetic, bit for bit, for the ops the kernels take over from it: an RMSNorm's
// sum of squares, SiLU, and log-softmax. The recorded reference outputs were computed through torch's
// own ops, and torch's results differ by CPU: its log-softmax sums 8 lanes under AVX2 and 16 under
// AVX-512. These give what torch's AVX2 build gives, on any CPU that runs the kernels.
//
//   exp8:        SLEEF's expf_u10 (torch's Vectorized<float>::exp), eight lanes.
//   sleef_log:   SLEEF's logf_u1 as its AVX2 build computes it (torch's Vectorized<float>::log).
//   torch_sum:   at::sum of a contiguous float32 row (SumKernel.cpp's cascade over 8-lane vectors,
//                which torch uses whatever its CPU capability).
//   exp_sum:     log-softmax's sum of exp(x - max) (vec::map_reduce_all over 8-lane vectors).
//
// -ffp-contract=off keeps every multiply and add here a separate rounding, as torch's are.

#pragma once

#include "intrinsics.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

namespace sluice {

inline __m256 exp8(__m256 d) {
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137f)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  // d - q ln 2, with ln 2 in two parts.
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  // Times 2^q as two powers of two, so neither overflows where the product does not.
  const __m256i half = _mm256_srai_epi32(q, 1);
  const auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(0x7f)), 23));
  };
  u = _mm256_mul_ps(_mm256_mul_ps(u, pow2(half)), pow2(_mm256_sub_epi32(q, half)));
  u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
  return _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(1e38f), d, _CMP_LT_OQ));
}

namespace detail {

inline int32_t float_bits(float f) {
  int32_t b;
  memcpy(&b, &f, 4);
  return b;
}

inline float bits_float(int32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

// A float2 value hi + lo, and the error-free sum of two floats.
struct Pair {
  float hi, lo;
};

inline Pair two_sum(float x, float y) {
  const float s = x + y, v = s - x;
  return {s, (x - (s - v)) + (y - v)};
}

}  // namespace detail

inline float sleef_log(float d) {
  using detail::Pair;
  if (d != d || d < 0.0f) return NAN;
  if (d == 0.0f) return -INFINITY;
  if (d == INFINITY) return INFINITY;
  const bool subnormal = d < 1.17549435e-38f;
  if (subnormal) d *= 4294967296.0f * 4294967296.0f;
  // d = m 2^e with m in [0.75, 1.5).
  int32_t e = ((detail::float_bits(d * (1.0f / 0.75f)) >> 23) & 0xff) - 0x7f;
  const float m = detail::bits_float(detail::float_bits(d) + (int32_t)((uint32_t)(-e) << 23));
  if (subnormal) e -= 64;
  const float ef = (float)e;
  // e ln 2 as a pair.
  Pair s = {0.69314718246459960938f * ef, 0.0f};
  s.lo = fmaf(-1.904654323148236017e-09f, ef, fmaf(0.69314718246459960938f, ef, -s.hi));
  // x = (m - 1) / (m + 1) as a pair.
  const Pair num = detail::two_sum(-1.0f, m), den = detail::two_sum(1.0f, m);
  const float inverse = 1.0f / den.hi;
  Pair x = {num.hi * inverse, 0.0f};
  const float u = fmaf(inverse, num.hi, -x.hi);
  const float v = fmaf(-den.lo, inverse, fmaf(-den.hi, inverse, 1.0f));
  x.lo = fmaf(x.hi, v, fmaf(num.lo, inverse, u));
  const float x2 = x.hi * x.hi;
  float t = 0.3027294874f;
  t = fmaf(t, x2, 0.3996108174f);
  t = fmaf(t, x2, 0.6666694880f);
  // s + 2x + x^3 t, in pairs.
  const float sum = s.hi + x.hi * 2.0f;
  const Pair a = {sum, (((s.hi - sum) + x.hi * 2.0f) + s.lo) + x.lo * 2.0f};
  const float w = (x2 * x.hi) * t;
  const float hi = a.hi + w;
  return hi + (((a.hi - hi) + w) + a.lo);
}

// The sum of load(i) for i in [0, n), in at::sum's order for a contiguous float32 row: 8-lane vectors
// summed as 4 interleaved rows of vectors, each through a cascade of 4 levels of accumulators, then the
// scalar tail and the 8 lanes in turn. `load(i)` gives the vector of elements [8i, 8i + 8); `scalar(i)`
// element i.
template <class VectorLoad, class ScalarLoad>
float torch_sum(int64_t n, VectorLoad load, ScalarLoad scalar) {
  constexpr int64_t kRows = 4, kLevels = 4;
  const int64_t vectors = n / 8, rows = vectors / kRows;
  int64_t ceil_log2 = 1;
  if (rows > 2) ceil_log2 = 64 - __builtin_clzll((uint64_t)(rows - 1));
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  __m256 acc[kLevels][kRows];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int64_t k = 0; k < kRows; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], load(i * kRows + k));
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kRows; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int64_t k = 0; k < kRows; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], load(i * kRows + k));
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kRows; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  __m256 total = acc[0][0];
  for (int64_t v = rows * kRows; v < vectors; ++v) total = _mm256_add_ps(total, load(v));
  for (int64_t k = 1; k < kRows; ++k) total = _mm256_add_ps(total, acc[0][k]);
  float result = 0.0f;
  for (int64_t e = vectors * 8; e < n; ++e) result += scalar(e);
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  for (float lane : lanes) result += lane;
  return result;
}

// The sum of exp(x[i] - max) over a row of n, in torch's AVX2 log-softmax order: one 8-lane
// accumulator over the whole vectors, the partial last vector added into its own lanes only, then the
// lanes folded in halves (lane i + 4 into i, i + 2, i + 1).
inline float exp_sum(const float* x, int64_t n, float max) {
  const __m256 top = _mm256_set1_ps(max);
  const auto tail = [&](int64_t first) {
    float padded[8] = {};
    std::copy(x + first, x + n, padded);
    return exp8(_mm256_sub_ps(_mm256_loadu_ps(padded), top));
  };
  if (n < 8) {
    float lanes[8];
    _mm256_storeu_ps(lanes, tail(0));
    float sum = lanes[0];
    for (int64_t i = 1; i < n; ++i) sum += lanes[i];
    return sum;
  }
  __m256 acc = exp8(_mm256_sub_ps(_mm256_loadu_ps(x), top));
  int64_t d = 8;
  for (; d < n - n % 8; d += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + d), top)));
  if (d < n) {
    float kept[8], summed[8];
    _mm256_storeu_ps(kept, acc);
    _mm256_storeu_ps(summed, _mm256_add_ps(acc, tail(d)));
    std::copy(summed, summed + (n - d), kept);
    acc = _mm256_loadu_ps(kept);
  }
  acc = _mm256_add_ps(acc, _mm256_permute2f128_ps(acc, acc, 1));
  acc = _mm256_add_ps(acc, _mm256_shuffle_ps(acc, acc, 0x4E));
  acc = _mm256_add_ps(acc, _mm256_shuffle_ps(acc, acc, 0xB1));
  return _mm256_cvtss_f32(acc);
}

// SiLU, x / (1 + exp(-x)), as torch's vectorized kernel computes it.
inline __m256 silu8(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

}  // namespace sluice
