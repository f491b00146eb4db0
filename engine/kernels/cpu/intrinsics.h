// The x86 vector intrinsics the kernels are written in (all but the linear kernel's tiles on ARM, which lanes.h
// writes in NEON): the compiler's own on x86-64, and on ARM (AArch64) SIMDe's translation of the same names into
// NEON, so one source gives every variant and the same bits: each intrinsic is IEEE arithmetic with one rounding
// per lane (fused multiply-adds stay fused, vfmaq_f32) whatever it runs on.

#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#else
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx2.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
#include <stdint.h>
#include <string.h>

// SIMDe fuses _mm256_fmadd_ps only where the target has a fused multiply-add and 128-bit vectors are its natural
// size; elsewhere it would multiply and add, two roundings, and every output would differ from x86's.
#if !defined(SIMDE_ARCH_ARM_FMA) || !SIMDE_NATURAL_VECTOR_SIZE_LE(128)
#error "the kernels' ARM build needs NEON's fused multiply-add at 128 bits"
#endif

// Names SIMDe does not alias: its rounding flag, and F16C's scalar conversions, which AArch64 does in one
// instruction each (fcvt; IEEE binary16, round to nearest even as _MM_FROUND_TO_NEAREST_INT asks).
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
inline float _cvtsh_ss(uint16_t bits) {
  __fp16 h;
  memcpy(&h, &bits, sizeof h);
  return h;
}
inline uint16_t _cvtss_sh(float x, int) {
  const __fp16 h = x;
  uint16_t bits;
  memcpy(&bits, &h, sizeof bits);
  return bits;
}
#endif
