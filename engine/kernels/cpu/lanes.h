// A linear-layer panel's 16 float32 lanes in this build's registers (one AVX-512 register, two AVX ones, four
// NEON ones), and the few operations the tiles of invariant.cpp need on them: loads, fused multiply-adds, and
// the widening of each weight form's bytes to float32. Every operation is exact (the widenings) or IEEE
// arithmetic with one rounding per lane, so each instruction set gives the same bits for the same lanes.
//
// The NEON operations are written in NEON rather than through SIMDe's translation of the x86 ones
// (intrinsics.h), with which the linear kernel ran 1.7 to 3.5 times the instructions (docs/performance.md): AVX's
// byte widenings, shuffles and per-lane shifts have no one-instruction NEON form, while NEON's own (ushll, tbl,
// ushl) do the same work directly.

#pragma once

#include "intrinsics.h"
#include <stdint.h>

#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace sluice::lanes {

#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
};
inline Lanes zero_lanes() { return {_mm512_setzero_ps()}; }
inline Lanes load_lanes(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store_lanes(float* p, Lanes a) { _mm512_storeu_ps(p, a.v); }
// acc + x * w, one rounding per lane.
inline Lanes fma_lanes(float x, Lanes w, Lanes acc) { return {_mm512_fmadd_ps(_mm512_set1_ps(x), w.v, acc.v)}; }
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Lanes mul_lanes(Lanes a, Lanes b) { return {_mm512_mul_ps(a.v, b.v)}; }
// a * b - c, one rounding per lane.
inline Lanes fms_lanes(Lanes a, Lanes b, Lanes c) { return {_mm512_fmsub_ps(a.v, b.v, c.v)}; }
inline Lanes halves_to_lanes(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p))}; }
// 16 bfloat16: each the top half of its float32, so widening is a 16-bit shift, exact.
inline Lanes bf16s_to_lanes(const uint8_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline Lanes uint8s_to_lanes(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)))};
}
inline Lanes int8s_to_lanes(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)))};
}
// 16 bytes holding lane j of one k in byte j's low nibble and of the next k in its high one, as 0.0 .. 15.0:
// the bytes widened to a lane each, and a permute reads each lane's low 4 bits as the index of its value
// (no mask, no conversion), then again after a shift for the next k. One load and widening serve two k.
inline void nibbles_to_lanes(const uint8_t* p, Lanes& even, Lanes& odd) {
  const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  even = {_mm512_permutexvar_ps(wide, values)};
  odd = {_mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), values)};
}
// Fields of `Bits` bits, lane c's at bits Bits * c to Bits * c + Bits - 1 of the 16 bytes at p, unsigned or
// (Signed) in two's complement: a byte shuffle gives each lane the 4 bytes from byte Bits * c / 8 on
// (`windows`), a shift left by the lane's `shifts` puts the field's top bit at bit 31, and a shift right by
// 32 - Bits (arithmetic where Signed, so extending the sign) brings it down.
template <int Bits, bool Signed>
inline Lanes fields_to_lanes(const uint8_t* p, __m512i windows, __m512i shifts) {
  const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p));
  const __m512i top = _mm512_sllv_epi32(_mm512_shuffle_epi8(bytes, windows), shifts);
  return {_mm512_cvtepi32_ps(Signed ? _mm512_srai_epi32(top, 32 - Bits) : _mm512_srli_epi32(top, 32 - Bits))};
}
// 10 bytes holding lane c's 5-bit value at bits 5c to 5c + 4 (16 bytes read).
template <bool Signed = false>
inline Lanes fives_to_lanes(const uint8_t* p) {
  return fields_to_lanes<5, Signed>(
      p,
      _mm512_setr_epi32(0x03020100, 0x03020100, 0x04030201, 0x04030201, 0x05040302, 0x06050403, 0x06050403,
                        0x07060504, 0x08070605, 0x08070605, 0x09080706, 0x09080706, 0x0A090807, 0x0B0A0908,
                        0x0B0A0908, 0x0C0B0A09),
      _mm512_setr_epi32(27, 22, 25, 20, 23, 26, 21, 24, 27, 22, 25, 20, 23, 26, 21, 24));  // 27 - 5c % 8
}
// 12 bytes holding lane c's 6-bit two's complement value at bits 6c to 6c + 5 (16 bytes read).
inline Lanes sixes_to_lanes(const uint8_t* p) {
  return fields_to_lanes<6, true>(
      p,
      _mm512_set_epi32(0x0E0D0C0B, 0x0D0C0B0A, 0x0C0B0A09, 0x0C0B0A09, 0x0B0A0908, 0x0A090807, 0x09080706,
                       0x09080706, 0x08070605, 0x07060504, 0x06050403, 0x06050403, 0x05040302, 0x04030201,
                       0x03020100, 0x03020100),
      _mm512_set_epi32(24, 22, 20, 26, 24, 22, 20, 26, 24, 22, 20, 26, 24, 22, 20, 26));  // 26 - 6c % 8
}
#elif defined(__aarch64__)
struct Lanes {
  float32x4_t v[4];
};
// The lanes whose quarter i is quarter(i).
template <class Quarter>
inline Lanes quarters(Quarter quarter) {
  return {{quarter(0), quarter(1), quarter(2), quarter(3)}};
}
inline Lanes zero_lanes() { return quarters([](int) { return vdupq_n_f32(0.0f); }); }
inline Lanes load_lanes(const float* p) { return quarters([&](int i) { return vld1q_f32(p + 4 * i); }); }
inline void store_lanes(float* p, Lanes a) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.v[i]);
}
inline Lanes fma_lanes(float x, Lanes w, Lanes acc) {
  return quarters([&](int i) { return vfmaq_n_f32(acc.v[i], w.v[i], x); });
}
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) {
  return quarters([&](int i) { return vfmaq_f32(c.v[i], a.v[i], b.v[i]); });
}
inline Lanes mul_lanes(Lanes a, Lanes b) { return quarters([&](int i) { return vmulq_f32(a.v[i], b.v[i]); }); }
// -c + a * b: negation is exact, so this is fmsub's one rounding of a * b - c.
inline Lanes fms_lanes(Lanes a, Lanes b, Lanes c) {
  return quarters([&](int i) { return vfmaq_f32(vnegq_f32(c.v[i]), a.v[i], b.v[i]); });
}
inline Lanes halves_to_lanes(const uint8_t* p) {
  const float16x8_t lo = vreinterpretq_f16_u8(vld1q_u8(p)), hi = vreinterpretq_f16_u8(vld1q_u8(p + 16));
  return {{vcvt_f32_f16(vget_low_f16(lo)), vcvt_high_f32_f16(lo), vcvt_f32_f16(vget_low_f16(hi)),
           vcvt_high_f32_f16(hi)}};
}
inline Lanes bf16s_to_lanes(const uint8_t* p) {
  const uint16x8_t lo = vld1q_u16((const uint16_t*)p), hi = vld1q_u16((const uint16_t*)p + 8);
  return {{vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(lo), 16)), vreinterpretq_f32_u32(vshll_high_n_u16(lo, 16)),
           vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(hi), 16)),
           vreinterpretq_f32_u32(vshll_high_n_u16(hi, 16))}};
}
// 16 bytes, unsigned, a lane each: widened to 16 then 32 bits (ushll), then converted.
inline Lanes widen_uint8s(uint8x16_t b) {
  const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_high_u8(b);
  return {{vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), vcvtq_f32_u32(vmovl_high_u16(lo)),
           vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), vcvtq_f32_u32(vmovl_high_u16(hi))}};
}
inline Lanes uint8s_to_lanes(const uint8_t* p) { return widen_uint8s(vld1q_u8(p)); }
inline Lanes int8s_to_lanes(const uint8_t* p) {
  const int8x16_t b = vld1q_s8((const int8_t*)p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_high_s8(b);
  return {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_high_s16(lo)),
           vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_high_s16(hi))}};
}
inline void nibbles_to_lanes(const uint8_t* p, Lanes& even, Lanes& odd) {
  const uint8x16_t b = vld1q_u8(p);
  even = widen_uint8s(vandq_u8(b, vdupq_n_u8(15)));
  odd = widen_uint8s(vshrq_n_u8(b, 4));
}
// As AVX-512's: a table lookup gives each lane its 4 bytes (windows, 4 a lane), then the two shifts.
template <int Bits, bool Signed>
inline Lanes fields_to_lanes(const uint8_t* p, const uint8_t* windows, const int32_t* shifts) {
  const uint8x16_t bytes = vld1q_u8(p);
  return quarters([&](int i) {
    const uint32x4_t window = vreinterpretq_u32_u8(vqtbl1q_u8(bytes, vld1q_u8(windows + 16 * i)));
    const uint32x4_t top = vshlq_u32(window, vld1q_s32(shifts + 4 * i));
    if constexpr (Signed) return vcvtq_f32_s32(vshrq_n_s32(vreinterpretq_s32_u32(top), 32 - Bits));
    else return vcvtq_f32_u32(vshrq_n_u32(top, 32 - Bits));
  });
}
template <bool Signed = false>
inline Lanes fives_to_lanes(const uint8_t* p) {
  static constexpr uint8_t windows[64] = {0, 1, 2, 3,  0, 1, 2, 3,   1, 2, 3,  4,  1, 2, 3,  4,  2, 3, 4,  5,  3, 4,
                                          5, 6, 3, 4,  5, 6, 4, 5,   6, 7, 5,  6,  7, 8, 5,  6,  7, 8, 6,  7,  8, 9,
                                          6, 7, 8, 9,  7, 8, 9, 10,  8, 9, 10, 11, 8, 9, 10, 11, 9, 10, 11, 12};
  // 27 - 5c % 8
  static constexpr int32_t shifts[16] = {27, 22, 25, 20, 23, 26, 21, 24, 27, 22, 25, 20, 23, 26, 21, 24};
  return fields_to_lanes<5, Signed>(p, windows, shifts);
}
inline Lanes sixes_to_lanes(const uint8_t* p) {
  static constexpr uint8_t windows[64] = {0, 1, 2,  3,  0, 1,  2,  3,  1, 2,  3,  4,  2,  3,  4,  5,
                                          3, 4, 5,  6,  3, 4,  5,  6,  4, 5,  6,  7,  5,  6,  7,  8,
                                          6, 7, 8,  9,  6, 7,  8,  9,  7, 8,  9,  10, 8,  9,  10, 11,
                                          9, 10, 11, 12, 9, 10, 11, 12, 10, 11, 12, 13, 11, 12, 13, 14};
  // 26 - 6c % 8
  static constexpr int32_t shifts[16] = {26, 20, 22, 24, 26, 20, 22, 24, 26, 20, 22, 24, 26, 20, 22, 24};
  return fields_to_lanes<6, true>(p, windows, shifts);
}
#else
struct Lanes {
  __m256 lo, hi;
};
inline Lanes zero_lanes() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Lanes load_lanes(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store_lanes(float* p, Lanes a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Lanes fma_lanes(float x, Lanes w, Lanes acc) {
  const __m256 a = _mm256_set1_ps(x);
  return {_mm256_fmadd_ps(a, w.lo, acc.lo), _mm256_fmadd_ps(a, w.hi, acc.hi)};
}
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Lanes mul_lanes(Lanes a, Lanes b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Lanes fms_lanes(Lanes a, Lanes b, Lanes c) {
  return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)};
}
inline Lanes halves_to_lanes(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p + 1))};
}
inline __m256 bf16s_to_floats(const uint8_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Lanes bf16s_to_lanes(const uint8_t* p) { return {bf16s_to_floats(p), bf16s_to_floats(p + 16)}; }
inline Lanes uint8s_to_lanes(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
inline Lanes int8s_to_lanes(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))))};
}
inline void nibbles_to_lanes(const uint8_t* p, Lanes& even, Lanes& odd) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
  const __m256i mask = _mm256_set1_epi32(15);
  even = {_mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask))};
  odd = {_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4))};
}
// As AVX-512's, each half of the lanes shuffled from the same 16 bytes (the shifts repeat every 8 lanes).
template <int Bits, bool Signed>
inline Lanes fields_to_lanes(const uint8_t* p, __m256i windows_lo, __m256i windows_hi, __m256i shifts) {
  const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  auto lanes = [&](__m256i windows) {
    const __m256i top = _mm256_sllv_epi32(_mm256_shuffle_epi8(bytes, windows), shifts);
    return _mm256_cvtepi32_ps(Signed ? _mm256_srai_epi32(top, 32 - Bits) : _mm256_srli_epi32(top, 32 - Bits));
  };
  return {lanes(windows_lo), lanes(windows_hi)};
}
template <bool Signed = false>
inline Lanes fives_to_lanes(const uint8_t* p) {
  return fields_to_lanes<5, Signed>(p,
                                    _mm256_setr_epi32(0x03020100, 0x03020100, 0x04030201, 0x04030201, 0x05040302,
                                                      0x06050403, 0x06050403, 0x07060504),
                                    _mm256_setr_epi32(0x08070605, 0x08070605, 0x09080706, 0x09080706, 0x0A090807,
                                                      0x0B0A0908, 0x0B0A0908, 0x0C0B0A09),
                                    _mm256_setr_epi32(27, 22, 25, 20, 23, 26, 21, 24));
}
inline Lanes sixes_to_lanes(const uint8_t* p) {
  return fields_to_lanes<6, true>(p,
                                  _mm256_set_epi32(0x08070605, 0x07060504, 0x06050403, 0x06050403, 0x05040302,
                                                   0x04030201, 0x03020100, 0x03020100),
                                  _mm256_set_epi32(0x0E0D0C0B, 0x0D0C0B0A, 0x0C0B0A09, 0x0C0B0A09, 0x0B0A0908,
                                                   0x0A090807, 0x09080706, 0x09080706),
                                  _mm256_set_epi32(24, 22, 20, 26, 24, 22, 20, 26));
}
#endif

}  // namespace sluice::lanes
