// Batch-invariant float32 kernels for x86 CPUs with AVX2 and FMA or with AVX-512, and for AArch64's NEON (the
// avx2-fma, avx512 and neon variants of native.py: one build each), the linear layer's weights held in the form
// they ship in (float32, bfloat16, float16, GGUF Q8_0, Q4_1, Q5_0, Q5_1, Q2_K, Q4_K, Q5_K or Q6_K blocks, or the Q8_F32
// and Q8_F32_16 blocks other GGUF types are rewritten as) and widened exactly to float32 in registers.
//
// A row's result here depends on that row's inputs alone: every output element is one
// chain of fused multiply-adds in a fixed order (k = 0, 1, ..., K-1 for a linear layer;
// key 0, 1, ..., n-1 for attention), whatever the number of rows, their place in the
// batch, the tile that computes them, the thread that runs the tile or the variant's vector width. BLAS
// libraries pick kernels and reduction splits by the matrix's shape, so the same token gets different
// bits alone and in a batch; these kernels never do.
//
// Loaded with ctypes (engine/kernels/cpu/native.py); OpenMP resolves to the libgomp that
// torch has already loaded, so both share one thread pool.

#include "intrinsics.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "invariant.h"
#include "lanes.h"
#include "vector_math.h"

namespace {

using sluice::exp256;
using sluice::hsum;
using sluice::row_max;
using namespace sluice::lanes;

constexpr int kPanel = 16;  // output columns per packed weight panel: one Lanes (lanes.h)
// Columns per block of sl_linear's block maxima: the sampler's block (kBlock in sampling.cpp).
constexpr int64_t kMaxBlock = 256;

// The forms a packed weight's panel holds its 16 columns in, each read one group of k at a time and
// widened in registers to exactly the float32 values the checkpoint's own conversion gives: so a
// kernel over any form computes the float32 kernel's bits while reading fewer bytes.
//   kF32:  16 floats per k.
//   kBF16: 16 bfloat16 per k; widening is a 16-bit shift, exact.
//   kF16:  16 float16 per k; widening is F16C's conversion (NEON's), exact.
//   kQ8_0: per 32 k, the columns' scales d (fp16), then 32 x 16 int8; w = d * q, as GGUF's
//          dequantizer computes it in float32.
//   kQ8_F32: kQ8_0's with float32 d: no GGUF type of its own, the form GGUF types whose weights are a small
//          integer times a per-32 scale that fp16 cannot hold are rewritten as (engine/model/gguf_transcode.py).
//   kQ8_F32_16: kQ8_F32's with groups of 16 k, for the GGUF types whose scales are per 16 weights.
//   kQ4_1: per 32 k, the scales d then the offsets m (fp16), then 16 x 16 bytes, one per two k: byte j
//          holding column j at the even k in its low nibble and at the odd k in its high one (so one 16-byte
//          load and widening serve two k); w = (d * q) + m, two roundings, as GGUF's
//          dequantizer computes it. d * q is exact in float32 (11 significant bits times 4), so one FMA
//          rounds the same sum once: the kernels take the FMA, the scalar variant the two roundings.
//   kQ5_0: per 32 k, 32 x 10 bytes of q (GGUF's 5 bits less 16) in 5-bit two's complement, column c's at bits
//          5c to 5c + 4 (kQ5_K's fields, sign-extended by the second shift), then the columns' d (fp16): after
//          the fields, so the last k's 16-byte load stays in its group. w = d * q, as GGUF's dequantizer
//          computes it, exact in float32 (11 significant bits times 5).
//   kQ5_1: kQ5_0's with GGUF's 5 bits as they are, unsigned, and the offsets m (fp16) after d; w = (d * q) + m,
//          two roundings in GGUF's dequantizer, one FMA in the kernels as kQ4_1's (d * q is still exact). Both
//          panels hold as many bytes a weight as the GGUF blocks they came from.
//   kQ4_K: per 256 k, the columns' d then dmin (fp16); then per 32 k their 6-bit scales sc then mins m (a
//          byte each) and 16 x 16 bytes of nibbles as kQ4_1's; w = (d * sc) * q - (dmin * m), as GGUF's
//          dequantizer computes it. Both products with sc and m, and (d * sc) * q, are exact in float32
//          (11 + 6 + 4 significant bits), so only the subtraction rounds: one FMA (a fused multiply-
//          subtract) in the kernels, the written-out operations in the scalar variant.
//   kQ5_K: kQ4_K's with 5-bit q: per 256 k, d then dmin; per 32 k, 32 x 10 bytes of q (column c's at bits 5c
//          to 5c + 4, widened as kQ6_K's fields are), then sc and m, so the last k's 16-byte load stays in its
//          group. (d * sc) * q still has at most 22 significant bits, exact, so w = (d * sc) * q - (dmin * m)
//          rounds once as kQ4_K's does.
//   kQ6_K: per 256 k, the columns' d (fp16); then per 16 k, 16 x 12 bytes of q (GGUF's 6 bits less 32) in
//          6-bit two's complement, column c's at bits 6c to 6c + 5, and the columns' int8 scales; w = (d *
//          scale) * q, as GGUF's dequantizer computes it: d * scale is exact, the product with q rounds once.
//          A byte shuffle gives each lane the 4 bytes holding its field, two shifts sign-extend it in place.
//   kQ2_K: kQ4_K's with groups of 16 k: per 256 k, d then dmin; per 16 k, sc and m (GGUF's 4 bits each, a byte
//          each here) and 8 x 16 bytes of nibbles holding GGUF's 2-bit q; w = (d * sc) * q - (dmin * m), one
//          rounding as kQ4_K's. 5.1 bits a weight where the blocks hold 2.6: a 2-bit widening would read fewer.
// The k-quants' super-block scales sit in a header before each 256 k of groups, read once a group: a Q6_K
// panel holds as many bytes a weight as the GGUF blocks it came from, a Q4_K one 148 for each 144 and a Q5_K
// one 180 for each 176 (their 6-bit scales and mins unpacked to a byte each, which the kernels then read with
// one load).
enum Form : int64_t {
  kF32 = 0,
  kBF16 = 1,
  kQ8_0 = 2,
  kQ4_1 = 3,
  kQ4_K = 4,
  kQ6_K = 5,
  kQ5_K = 6,
  kQ5_0 = 7,
  kQ5_1 = 8,
  kQ2_K = 9,
  kQ8_F32 = 10,
  kQ8_F32_16 = 11,
  kF16 = 12,
};

// A form's groups of kGroup k, each with its own Scales, GroupBytes apart in a panel; sl_pack reads the
// source's blocks of kBlock k.
template <int Group, int64_t GroupBytes>
struct Groups {
  static constexpr int kGroup = Group, kBlock = Group, kStep = 1;
  static int64_t offset(int64_t g) { return g * GroupBytes; }
  static constexpr int64_t bytes(int64_t k_dim) { return k_dim / Group * GroupBytes; }
};

// GGUF's k-quants: super-blocks of 256 k, each a header of HeaderBytes (the columns' scales of the scales)
// then its groups.
template <int Group, int64_t GroupBytes, int64_t HeaderBytes>
struct SuperBlocks {
  static constexpr int kGroup = Group, kBlock = 256, kStep = 1;
  static constexpr int64_t kBlockBytes = HeaderBytes + kBlock / Group * GroupBytes;
  static int64_t header(int64_t g) { return g / (kBlock / Group) * kBlockBytes; }
  static int64_t offset(int64_t g) { return header(g) + HeaderBytes + g % (kBlock / Group) * GroupBytes; }
  static constexpr int64_t bytes(int64_t k_dim) { return k_dim / kBlock * kBlockBytes; }
};

// Every form: scales(panel, g), the Scales of group g; widen(group, scales, kk, w), the group's 16 columns at
// its k kk .. kk + kStep - 1 into w[0 .. kStep) (group: panel + offset(g); kStep 2 where two k share a load
// and its widening); scalar(panel, k, c), column c at k, the same value; kScaleLanes, the Lanes of a Scales
// that the tile uses (panels_for).

struct F32 : Groups<1, kPanel * 4> {
  struct Scales {};
  static constexpr int kScaleLanes = 0;
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static void widen(const uint8_t* group, const Scales&, int, Lanes* w) { w[0] = load_lanes((const float*)group); }
  static float scalar(const uint8_t* panel, int64_t k, int c) { return ((const float*)(panel + offset(k)))[c]; }
};

struct BF16 : Groups<1, kPanel * 2> {
  struct Scales {};
  static constexpr int kScaleLanes = 0;
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static void widen(const uint8_t* group, const Scales&, int, Lanes* w) { w[0] = bf16s_to_lanes(group); }
  static float scalar(const uint8_t* panel, int64_t k, int c) {
    const uint32_t bits = (uint32_t)((const uint16_t*)(panel + offset(k)))[c] << 16;
    float w;
    memcpy(&w, &bits, 4);
    return w;
  }
};

inline float half_to_float(const uint8_t* halves, int c) { return _cvtsh_ss(((const uint16_t*)halves)[c]); }

struct F16 : Groups<1, kPanel * 2> {
  struct Scales {};
  static constexpr int kScaleLanes = 0;
  static Scales scales(const uint8_t*, int64_t) { return {}; }
  static void widen(const uint8_t* group, const Scales&, int, Lanes* w) { w[0] = halves_to_lanes(group); }
  static float scalar(const uint8_t* panel, int64_t k, int c) { return half_to_float(panel + offset(k), c); }
};

// Column c's 4-bit value at k kk of nibbles laid out as kQ4_1's.
inline int nibble(const uint8_t* nibbles, int kk, int c) { return nibbles[kk / 2 * kPanel + c] >> kk % 2 * 4 & 15; }
inline void set_nibble(uint8_t* nibbles, int kk, int c, int q) {
  nibbles[kk / 2 * kPanel + c] |= (uint8_t)(q << kk % 2 * 4);
}

// Column c's 5-bit field at k kk of fields laid out as kQ5_K's (10 bytes a k, column c's at bits 5c to 5c + 4).
inline int five(const uint8_t* fields, int kk, int c) {
  uint16_t window;
  memcpy(&window, fields + kk * 10 + 5 * c / 8, 2);
  return window >> 5 * c % 8 & 31;
}
inline void set_five(uint8_t* fields, int kk, int c, int q) {
  uint16_t window;
  memcpy(&window, fields + kk * 10 + 5 * c / 8, 2);
  window |= (uint16_t)(q << 5 * c % 8);
  memcpy(fields + kk * 10 + 5 * c / 8, &window, 2);
}

// Q8_0 and Q8_F32 (Wide: float32 d), Q8_F32_16 (Group 16); a group: d, then the int8 values.
template <bool Wide, int Group = 32>
struct Int8s : Groups<Group, kPanel * (Wide ? 4 : 2) + Group * kPanel> {
  using Base = Groups<Group, kPanel * (Wide ? 4 : 2) + Group * kPanel>;
  static constexpr int64_t kValues = kPanel * (Wide ? 4 : 2);
  struct Scales {
    Lanes d;
  };
  static constexpr int kScaleLanes = 1;
  static Scales scales(const uint8_t* panel, int64_t g) {
    const uint8_t* group = panel + Base::offset(g);
    return {Wide ? load_lanes((const float*)group) : halves_to_lanes(group)};
  }
  static void widen(const uint8_t* group, const Scales& s, int kk, Lanes* w) {
    w[0] = mul_lanes(int8s_to_lanes(group + kValues + kk * kPanel), s.d);
  }
  static float scalar(const uint8_t* panel, int64_t k, int c) {
    const uint8_t* group = panel + Base::offset(k / Group);
    const float d = Wide ? ((const float*)group)[c] : half_to_float(group, c);
    return (float)((const int8_t*)group)[kValues + k % Group * kPanel + c] * d;
  }
};
using Q8_0 = Int8s<false>;
using Q8_F32 = Int8s<true>;
using Q8_F32_16 = Int8s<true, 16>;

struct Q4_1 : Groups<32, kPanel * 4 + 32 * kPanel / 2> {
  static constexpr int kStep = 2;
  struct Scales {
    Lanes d, m;
  };
  static constexpr int kScaleLanes = 2;
  static Scales scales(const uint8_t* panel, int64_t g) {
    const uint8_t* group = panel + offset(g);
    return {halves_to_lanes(group), halves_to_lanes(group + kPanel * 2)};
  }
  static void widen(const uint8_t* group, const Scales& s, int kk, Lanes* w) {
    nibbles_to_lanes(group + kPanel * 4 + kk / 2 * kPanel, w[0], w[1]);
    w[0] = fma_lanes(s.d, w[0], s.m);
    w[1] = fma_lanes(s.d, w[1], s.m);
  }
  static float scalar(const uint8_t* panel, int64_t k, int c) {
    const uint8_t* group = panel + offset(k / kGroup);
    const float q = (float)nibble(group + kPanel * 4, (int)(k % kGroup), c);
    return half_to_float(group, c) * q + half_to_float(group + kPanel * 2, c);
  }
};

// Q5_0 and Q5_1 (Offset: with m): a group is its 5-bit fields, then d, then m.
template <bool Offset>
struct Fives : Groups<32, 32 * 10 + kPanel * (Offset ? 4 : 2)> {
  using Base = Groups<32, 32 * 10 + kPanel * (Offset ? 4 : 2)>;
  static constexpr int64_t kScales = 32 * 10;  // d's offset in a group (m follows)
  struct Scales {
    Lanes d, m;  // m: Q5_1's alone
  };
  static constexpr int kScaleLanes = Offset ? 2 : 1;
  static Scales scales(const uint8_t* panel, int64_t g) {
    const uint8_t* group = panel + Base::offset(g) + kScales;
    return {halves_to_lanes(group), Offset ? halves_to_lanes(group + kPanel * 2) : zero_lanes()};
  }
  static void widen(const uint8_t* group, const Scales& s, int kk, Lanes* w) {
    if constexpr (Offset) w[0] = fma_lanes(s.d, fives_to_lanes(group + kk * 10), s.m);
    else w[0] = mul_lanes(fives_to_lanes<true>(group + kk * 10), s.d);
  }
  static float scalar(const uint8_t* panel, int64_t k, int c) {
    const uint8_t* group = panel + Base::offset(k / 32);
    const int field = five(group, (int)(k % 32), c);
    const float d = half_to_float(group + kScales, c);
    if constexpr (Offset) return d * (float)field + half_to_float(group + kScales + kPanel * 2, c);
    else return d * (float)((field ^ 16) - 16);  // the field's two's complement read back
  }
};
using Q5_0 = Fives<false>;
using Q5_1 = Fives<true>;

// Q4_K and Q5_K (Fifths: 5-bit q), groups of 32 k, and Q2_K, groups of 16 k; a group: sc, m, then the nibbles
// (kQ4_1's layout), or the 5-bit fields, then sc, m.
template <bool Fifths, int Group = 32>
struct MinScaled : SuperBlocks<Group, kPanel * 2 + Group * (Fifths ? 10 : kPanel / 2), kPanel * 4> {
  using Base = SuperBlocks<Group, kPanel * 2 + Group * (Fifths ? 10 : kPanel / 2), kPanel * 4>;
  static constexpr int kStep = Fifths ? 1 : 2;  // nibbles: two k a load, as kQ4_1's
  // Offsets in a group of the scales sc (the mins m follow them) and of the values q.
  static constexpr int64_t kScales = Fifths ? Group * 10 : 0, kValues = Fifths ? 0 : kPanel * 2;
  struct Scales {
    Lanes d, m;  // d * sc and dmin * m
  };
  static constexpr int kScaleLanes = 2;
  static Scales scales(const uint8_t* panel, int64_t g) {
    const uint8_t* head = panel + Base::header(g);
    const uint8_t* group = panel + Base::offset(g) + kScales;
    return {mul_lanes(halves_to_lanes(head), uint8s_to_lanes(group)),
            mul_lanes(halves_to_lanes(head + kPanel * 2), uint8s_to_lanes(group + kPanel))};
  }
  static void widen(const uint8_t* group, const Scales& s, int kk, Lanes* w) {
    if constexpr (Fifths) {
      w[0] = fms_lanes(s.d, fives_to_lanes(group + kk * 10), s.m);
    } else {
      nibbles_to_lanes(group + kValues + kk / 2 * kPanel, w[0], w[1]);
      w[0] = fms_lanes(s.d, w[0], s.m);
      w[1] = fms_lanes(s.d, w[1], s.m);
    }
  }
  static float scalar(const uint8_t* panel, int64_t k, int c) {
    const uint8_t* head = panel + Base::header(k / Group);
    const uint8_t* group = panel + Base::offset(k / Group);
    const float d = half_to_float(head, c) * (float)group[kScales + c];
    const float m = half_to_float(head + kPanel * 2, c) * (float)group[kScales + kPanel + c];
    const int q = Fifths ? five(group, (int)(k % Group), c) : nibble(group + kValues, (int)(k % Group), c);
    return d * (float)q - m;
  }
};
using Q4_K = MinScaled<false>;
using Q5_K = MinScaled<true>;
using Q2_K = MinScaled<false, 16>;

struct Q6_K : SuperBlocks<16, 16 * 12 + kPanel, kPanel * 2> {
  static constexpr int64_t kScales = 16 * 12;  // the scales' offset in a group
  struct Scales {
    Lanes d;  // d * scale
  };
  static constexpr int kScaleLanes = 1;
  static Scales scales(const uint8_t* panel, int64_t g) {
    return {mul_lanes(halves_to_lanes(panel + header(g)), int8s_to_lanes(panel + offset(g) + kScales))};
  }
  // Reads 16 bytes from k kk's 12: the last k's 4 more are the group's scales.
  static void widen(const uint8_t* group, const Scales& s, int kk, Lanes* w) {
    w[0] = mul_lanes(s.d, sixes_to_lanes(group + kk * 12));
  }
  static float scalar(const uint8_t* panel, int64_t k, int c) {
    const uint8_t* group = panel + offset(k / kGroup);
    const float d = half_to_float(panel + header(k / kGroup), c) * (float)((const int8_t*)group)[kScales + c];
    uint32_t window;
    memcpy(&window, group + k % kGroup * 12 + 6 * c / 8, 4);
    return d * (float)((int32_t)(window << (26 - 6 * c % 8)) >> 26);
  }
};

// A tile reads its panels as that many streams of a few kilobytes each, a new set every tile: too short for
// the hardware's prefetchers to follow, so weights that miss the caches (all of a step's) came at half the
// rate they do from L2. Each group's turn fetches the group about four ahead in every panel (the k-quants'
// headers make the stride an average), and in a tile's last groups the first groups of the next tile's panels,
// which otherwise started cold (all but the first: past a panel's end lies the next panel's start). From
// memory, 1-row Q4_1 1.9x (avx512) and 1.5x (avx2-fma) the multiply-adds a second, a decode step at one stream
// 0.85x the time (Zen 5); the next tile's groups a 1-stream step 0.94x (Zen 2, docs/performance.md). Not for
// float32 and the 16-bit floats, whose long runs a k the hardware follows (float32 lost 10% with it).
constexpr int64_t kPrefetchGroups = 4;
template <class F>
constexpr int64_t kGroupBytes = F::bytes(256) / (256 / F::kGroup);

// Whether a tile of Rows rows keeps its panels' scales in memory, re-read from L1 each k step (as the multiply-
// adds' memory operands), rather than in registers: on AVX2 for tiles of one to three rows (two panels of a form
// with scales: panels_for). Their accumulators, two panels' scales (Q4_1's d and m are eight registers), the
// widened weights and x do not fit AVX's sixteen registers together, and GCC then spilled accumulators, so
// each k's chain waited on a store and a load. The arithmetic is the same either way (docs/performance.md,
// "One row on AVX2").
template <class F, int Rows>
constexpr bool kScalesInMemory =
#if defined(__AVX512F__) || defined(__aarch64__)
    false;
#else
    Rows <= 3 && F::kScaleLanes > 0;
#endif

// Rows x (panels * 16) outputs, each a k-ordered FMA chain from zero. Every variant does the
// same arithmetic per element; they differ only in how many elements share a pass over k. A panel's
// weights are widened and used at once, so only the accumulators stay in registers across panels
// (widening them all first spilled accumulators to memory, each k then waiting on a store).
template <class F, int Rows, int Panels>
inline void tile(const float* x, int64_t x_stride, const uint8_t* wp, int64_t panel_stride, int64_t k_dim,
                 float* y, int64_t y_stride) {
  Lanes acc[Rows][Panels];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) acc[r][p] = zero_lanes();
  const int64_t groups = k_dim / F::kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group[Panels];
    typename F::Scales scales[Panels];
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      group[p] = wp + p * panel_stride + F::offset(g);
      scales[p] = F::scales(wp + p * panel_stride, g);
    }
    if constexpr (F::kGroup > 1) {
      const int64_t ahead = g + kPrefetchGroups - groups;  // >= 0: in the next tile's panels
      const uint8_t* next = wp + Panels * panel_stride + ahead * kGroupBytes<F>;
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p) {
        const char* target = ahead >= 0 ? (const char*)next + p * panel_stride
                                        : (const char*)group[p] + kPrefetchGroups * kGroupBytes<F>;
        for (int64_t line = 0; line < kGroupBytes<F>; line += 64) _mm_prefetch(target + line, _MM_HINT_T0);
      }
    }
    // The scales' address escapes, so a compiler barrier each k step has them re-read rather than held.
    if constexpr (kScalesInMemory<F, Rows>) asm volatile("" : : "r"(scales) : "memory");
    for (int kk = 0; kk < F::kGroup; kk += F::kStep) {
      if constexpr (kScalesInMemory<F, Rows>) asm volatile("" : : : "memory");
      const int64_t k = g * F::kGroup + kk;
#pragma GCC unroll 8
      for (int p = 0; p < Panels; ++p) {
        Lanes w[F::kStep];
        F::widen(group[p], scales[p], kk, w);
#pragma GCC unroll 2
        for (int s = 0; s < F::kStep; ++s)
#pragma GCC unroll 8
          for (int r = 0; r < Rows; ++r) acc[r][p] = fma_lanes(x[r * x_stride + k + s], w[s], acc[r][p]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) store_lanes(y + r * y_stride + p * kPanel, acc[r][p]);
}

// Panels per tile: AVX's twelve accumulator registers of sixteen as 6 rows x 1 panel, 3 x 2 and, for float32
// and the 16-bit floats, 1 x 4. A row of a form with scales takes 2 panels (its scales in memory: kScalesInMemory),
// whose 4 chains keep up with the widening: with 4, the 18- and 6-panel shares of a decode step's q, k, v, o
// and down ended in two 1-panel tiles, and a 1-stream step on a Zen 2 took 1.05x the time; float32 and
// bfloat16, with no widening to hide the chains' latency, ran slower with 2 (docs/performance.md, "One row on
// AVX2"). AVX-512's thirty-two registers take 4 panels for any number of rows (up to 24 accumulators). A NEON
// panel is four of its thirty-two registers, and NEON's arithmetic takes no operand from memory, so there the
// tile is as wide as its accumulators, its panels' scales and one widened k step fit in 24 registers, the
// other 8 left to the widening: wider tiles spilled to the stack every k, 1.1x to 1.3x the instructions (Q4_1
// at 1 row in 4 panels against 1, Q6_K at 3 rows in 2 against 1; docs/performance.md).
template <class F, int Rows>
constexpr int panels_for() {
#if defined(__AVX512F__)
  return 4;
#elif defined(__aarch64__)
  auto fits = [](int panels) { return Rows * panels + panels * F::kScaleLanes + F::kStep <= 6; };
  return fits(4) ? 4 : (fits(2) ? 2 : 1);
#else
  return Rows >= 4 ? 1 : (Rows >= 2 || F::kScaleLanes > 0 ? 2 : 4);
#endif
}

template <class F, int Rows>
void rows_over_panels(const float* x, int64_t k_dim, const uint8_t* wp, int64_t p_begin, int64_t p_end, float* out,
                      int64_t out_stride) {
  constexpr int wide = panels_for<F, Rows>();
  const int64_t panel_stride = F::bytes(k_dim);
  int64_t p = p_begin;
  for (; p + wide <= p_end; p += wide)
    tile<F, Rows, wide>(x, k_dim, wp + p * panel_stride, panel_stride, k_dim, out + p * kPanel, out_stride);
  for (; p < p_end; ++p)
    tile<F, Rows, 1>(x, k_dim, wp + p * panel_stride, panel_stride, k_dim, out + p * kPanel, out_stride);
}

template <class F>
void row_block(int rows, const float* x, int64_t k_dim, const uint8_t* wp, int64_t p_begin, int64_t p_end,
               float* out, int64_t out_stride) {
  switch (rows) {
    case 1: rows_over_panels<F, 1>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    case 2: rows_over_panels<F, 2>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    case 3: rows_over_panels<F, 3>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    case 4: rows_over_panels<F, 4>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    case 5: rows_over_panels<F, 5>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    default: rows_over_panels<F, 6>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
  }
}

// The scalar variant of row_block: one element at a time, each the same k-ordered chain of fused
// multiply-adds over the same widened weights, so it gives the vector variant's bits. It is the
// reference the vector variants are tested against, and the form a new variant starts from.
template <class F>
void row_block_scalar(int rows, const float* x, int64_t k_dim, const uint8_t* wp, int64_t p_begin, int64_t p_end,
                      float* out, int64_t out_stride) {
  const int64_t panel_stride = F::bytes(k_dim);
  for (int r = 0; r < rows; ++r)
    for (int64_t p = p_begin; p < p_end; ++p)
      for (int c = 0; c < kPanel; ++c) {
        float acc = 0.0f;
        for (int64_t k = 0; k < k_dim; ++k) acc = fmaf(x[r * k_dim + k], F::scalar(wp + p * panel_stride, k, c), acc);
        out[r * out_stride + p * kPanel + c] = acc;
      }
}

using RowBlock = void (*)(int, const float*, int64_t, const uint8_t*, int64_t, int64_t, float*, int64_t);

template <class F>
int64_t panel_bytes(int64_t k_dim) {
  return F::bytes(k_dim);
}

// Panels [0, count) of a packed weight widened into float32 panels (F32's layout) at `out`: the same
// values the tiles widen to in registers.
template <class F>
void widen_panels(const uint8_t* wp, int64_t count, int64_t k_dim, float* out) {
  for (int64_t p = 0; p < count; ++p)
    for (int64_t g = 0; g < k_dim / F::kGroup; ++g) {
      const uint8_t* panel = wp + p * panel_bytes<F>(k_dim);
      const typename F::Scales scales = F::scales(panel, g);
      for (int kk = 0; kk < F::kGroup; kk += F::kStep) {
        Lanes w[F::kStep];
        F::widen(panel + F::offset(g), scales, kk, w);
        for (int s = 0; s < F::kStep; ++s) store_lanes(out + (p * k_dim + g * F::kGroup + kk + s) * kPanel, w[s]);
      }
    }
}

// Rows past which a strip of panels is widened into memory once rather than in registers by every row block:
// writing the strip and reading it back costs about what three blocks of six rows spend widening in
// registers. A decode step of the default model without strips, on both variants: 11-20% faster at 8 to
// 12 rows, 4-6% at 16, the same at 20 to 32, 12% slower at 64 (docs/performance.md).
#ifndef SL_STRIP_ROWS
#define SL_STRIP_ROWS 16  // a build flag only for bench/cpu_step.py --strip-rows
#endif
constexpr int64_t kStripRows = SL_STRIP_ROWS;

// Row block b of the (m_dim + 5) / 6 that M rows take: its first row and its rows. Blocks of six, but for a tail
// of fewer than four, which the last full block shares (8 rows as 4 and 4, 32 as 6, 6, 6, 6, 4, 4): a block of
// one to three rows does too few multiply-adds a k to hide reading its panels' weights (from L2 where a strip
// was widened), and six-row blocks ran faster than even shares.
inline std::pair<int64_t, int> row_block_span(int64_t m_dim, int64_t row_blocks, int64_t b) {
  const int64_t tail = m_dim % 6;
  if (tail == 0 || tail >= 4 || row_blocks < 2 || b < row_blocks - 2)
    return {6 * b, (int)std::min<int64_t>(6, m_dim - 6 * b)};
  const int64_t pair = 6 + tail, first = 6 * (row_blocks - 2);
  return b == row_blocks - 2 ? std::pair<int64_t, int>{first, (int)((pair + 1) / 2)}
                             : std::pair<int64_t, int>{first + (pair + 1) / 2, (int)(pair / 2)};
}

// Panels [p_first, p_last) of y[M, N] = x[M, K] @ W.T, on the calling thread; block_max as `linear` says.
template <class F>
void linear_panels(bool scalar, const float* x, int64_t m_dim, int64_t k_dim, const uint8_t* wp, int64_t n_dim,
                   float* y, float* block_max, int64_t p_first, int64_t p_last) {
  const int64_t full = n_dim / kPanel;
  const int64_t block_panels = kMaxBlock / kPanel;
  const int64_t num_blocks = ((n_dim + kPanel - 1) / kPanel + block_panels - 1) / block_panels;
  const bool widen_strips = !scalar && !std::is_same<F, F32>::value && m_dim > kStripRows;
  std::vector<float> strip(widen_strips ? 4 * k_dim * kPanel : 0);
  for (int64_t p_begin = p_first; p_begin < p_last; p_begin += 4) {
    const int64_t p_end = std::min(p_begin + 4, p_last);
    const int64_t p_full = std::min(p_end, full);
    // Panels [p_begin, p_end) are panels [0, p_end - p_begin) of `base`, read by `block`.
    RowBlock block = scalar ? row_block_scalar<F> : row_block<F>;
    const uint8_t* base = wp + p_begin * panel_bytes<F>(k_dim);
    int64_t stride = panel_bytes<F>(k_dim);
    if (widen_strips) {
      widen_panels<F>(base, p_end - p_begin, k_dim, strip.data());
      block = row_block<F32>;
      base = (const uint8_t*)strip.data();
      stride = panel_bytes<F32>(k_dim);
    }
    // The next strip's weights, fetched into L2 a share before each row block: the widening reads them from
    // there rather than waiting on memory between blocks that compute from the cache.
    const uint8_t* next = wp + p_end * panel_bytes<F>(k_dim);
    const int64_t next_bytes = widen_strips ? (std::min(p_end + 4, p_last) - p_end) * panel_bytes<F>(k_dim) : 0;
    const int64_t row_blocks = (m_dim + 5) / 6;
    const int64_t share = widen_strips ? ((next_bytes + row_blocks - 1) / row_blocks + 63) / 64 * 64 : 0;
    for (int64_t b = 0; b < row_blocks; ++b) {
      const auto [m, rows] = row_block_span(m_dim, row_blocks, b);
      for (int64_t line = b * share; line < std::min(next_bytes, (b + 1) * share); line += 64)
        _mm_prefetch((const char*)next + line, _MM_HINT_T1);
      if (p_begin < p_full)
        block(rows, x + m * k_dim, k_dim, base, 0, p_full - p_begin, y + m * n_dim + p_begin * kPanel, n_dim);
      if (p_full < p_end) {
        // The last panel runs past N: compute it into scratch and keep the real columns.
        float spill[6 * kPanel];
        block(rows, x + m * k_dim, k_dim, base + (full - p_begin) * stride, 0, 1, spill, kPanel);
        for (int r = 0; r < rows; ++r)
          memcpy(y + (m + r) * n_dim + full * kPanel, spill + r * kPanel, (n_dim - full * kPanel) * sizeof(float));
      }
      if (block_max == nullptr) continue;
      // p_begin steps by 4 from a block boundary, so these columns lie in one block.
      const int64_t first_column = p_begin * kPanel, end_column = std::min(p_end * kPanel, n_dim);
      for (int r = 0; r < rows; ++r) {
        const float found = row_max(y + (m + r) * n_dim + first_column, end_column - first_column);
        float& slot = block_max[(m + r) * num_blocks + p_begin / block_panels];
        slot = p_begin % block_panels == 0 ? found : std::max(slot, found);
      }
    }
  }
}

// y[M, N] = x[M, K] @ W.T over a weight packed in form F. Threads split the output columns (never k);
// each walks its columns four panels at a time, over every row. With more than kStripRows rows, a
// strip of four panels is widened once into float32 in the thread's cache and the float32 tiles run
// over it, rather than each row block widening it again: the same values, so the same bits.
// `scalar`: the portable variant, one element at a time.
//
// With block_max (else null), also block_max[M, ceil(N / 256)]: the largest value of each row's
// 256-column blocks, taken while the tile is still in L1, so the sampler never reads a whole row of
// logits to find its max. Threads then split the columns at block boundaries, so one thread owns each
// block; every element's arithmetic is the same either way.
template <class F>
void linear(bool scalar, const float* x, int64_t m_dim, int64_t k_dim, const uint8_t* wp, int64_t n_dim, float* y,
            float* block_max) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  const int64_t block_panels = kMaxBlock / kPanel;
  const int64_t num_blocks = (panels + block_panels - 1) / block_panels;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    int64_t p_first = panels * thread / threads, p_last = panels * (thread + 1) / threads;
    if (block_max != nullptr) {
      p_first = std::min(panels, num_blocks * thread / threads * block_panels);
      p_last = std::min(panels, num_blocks * (thread + 1) / threads * block_panels);
    }
    linear_panels<F>(scalar, x, m_dim, k_dim, wp, n_dim, y, block_max, p_first, p_last);
  }
}

// Experts' weights [N, K] in `form` at wp + e * expert_bytes, over the rows of x grouped by expert (counts[e]
// of them for expert e): in one parallel region, each thread its share of every expert's panels, so a
// step that hits many experts pays for one wake-up of the threads, not one per expert.
template <class F>
void grouped_linear(bool scalar, const float* x, int64_t k_dim, const int64_t* counts, int64_t num_experts,
                    const uint8_t* wp, int64_t expert_bytes, int64_t n_dim, float* y) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t p_first = panels * thread / threads, p_last = panels * (thread + 1) / threads;
    int64_t row = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
      if (counts[e] != 0)
        linear_panels<F>(scalar, x + row * k_dim, counts[e], k_dim, wp + e * expert_bytes, n_dim, y + row * n_dim,
                         nullptr, p_first, p_last);
      row += counts[e];
    }
  }
}

// The weight's 16-column panels, zero-padded past N: `column(n, b, panel)` writes column n's source block b
// (F::kBlock k) into its panel at `panel`, in the column's slots of the form's groups (F::offset).
template <class F, class Column>
void pack_panels(int64_t n_dim, int64_t k_dim, uint8_t* wp, Column column) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel, blocks = k_dim / F::kBlock;
  memset(wp, 0, panels * panel_bytes<F>(k_dim));
  // By panel: a byte may hold two weights (kQ4_1's nibbles, the 5-bit fields), so one thread writes each panel.
#pragma omp parallel for
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t n = p * kPanel; n < std::min(n_dim, (p + 1) * kPanel); ++n)
      for (int64_t b = 0; b < blocks; ++b) column(n, b, wp + p * panel_bytes<F>(k_dim));
}

// Q8_0's, Q8_F32's or Q8_F32_16's blocks (d, fp16 or float32, then a group's int8) into panels.
template <class F>
void pack_int8s(int64_t n_dim, int64_t k_dim, const uint8_t* src, uint8_t* wp) {
  constexpr int64_t scale_bytes = F::kValues / kPanel, block_bytes = scale_bytes + F::kGroup;
  pack_panels<F>(n_dim, k_dim, wp, [&](int64_t n, int64_t g, uint8_t* panel) {
    const uint8_t* block = src + (n * (k_dim / F::kGroup) + g) * block_bytes;
    uint8_t* dst = panel + F::offset(g);
    const int c = (int)(n % kPanel);
    memcpy(dst + c * scale_bytes, block, scale_bytes);
    for (int kk = 0; kk < F::kGroup; ++kk) dst[F::kValues + kk * kPanel + c] = block[scale_bytes + kk];
  });
}

// Column c's GGUF Q5_0 (Offset: Q5_1) block into its panel's group: d (and m) at the block's start, then 4 bytes
// of fifth bits (weight j's at bit j of their little-endian word) and 16 of nibbles (weight j in byte j's low
// nibble, weight j + 16 in its high one). Q5_0's fields hold q - 16 in two's complement: q's bits with the top
// one flipped.
template <bool Offset>
void pack_fives(const uint8_t* block, int c, uint8_t* group) {
  constexpr int halves = Offset ? 2 : 1;
  for (int h = 0; h < halves; ++h) memcpy(group + Fives<Offset>::kScales + h * kPanel * 2 + c * 2, block + h * 2, 2);
  uint32_t fifths;
  memcpy(&fifths, block + halves * 2, 4);
  const uint8_t* nibbles = block + halves * 2 + 4;
  for (int kk = 0; kk < 32; ++kk) {
    const int q = (kk < 16 ? nibbles[kk] & 15 : nibbles[kk - 16] >> 4) | (fifths >> kk & 1) << 4;
    set_five(group, kk, c, Offset ? q : q ^ 16);
  }
}

// Sub-block `sub`'s 6-bit scale and min from a Q4_K or Q5_K block's 12 bytes `s`: bytes 0-3 hold scales 0-3 in
// their low 6 bits and the high 2 bits of scales 4-7 above; bytes 4-7 the mins likewise; bytes 8-11 the low 4
// bits of scales 4-7, of mins 4-7 above.
inline void unpack_scale_min(const uint8_t* s, int sub, uint8_t* scale, uint8_t* min) {
  *scale = sub < 4 ? s[sub] & 63 : (s[sub + 4] & 15) | (s[sub - 4] >> 6) << 4;
  *min = sub < 4 ? s[sub + 4] & 63 : (s[sub + 4] >> 4) | (s[sub] >> 6) << 4;
}

// Column c's GGUF block b of a Q4_K or Q5_K weight into its panel: d, dmin at the block's start, the scales
// and mins at byte 4 (unpack_scale_min), the nibbles at `nibbles` (weight 64i + j, j < 32, in byte 32i + j's
// low nibble, weight 64i + 32 + j in its high one) and, for Q5_K, the fifth bits at `fifths` (weight 32i + j's
// at bit i of byte j).
template <class F>
void pack_min_scaled(const uint8_t* block, int64_t nibbles, const uint8_t* fifths, int c, uint8_t* panel, int64_t b) {
  uint8_t* head = panel + F::header(b * 8);
  memcpy(head + c * 2, block, 2);
  memcpy(head + kPanel * 2 + c * 2, block + 2, 2);
  for (int sub = 0; sub < 8; ++sub) {
    uint8_t* dst = panel + F::offset(b * 8 + sub);
    unpack_scale_min(block + 4, sub, dst + F::kScales + c, dst + F::kScales + kPanel + c);
    for (int kk = 0; kk < 32; ++kk) {
      const int q = block[nibbles + sub / 2 * 32 + kk] >> (sub % 2 * 4) & 15;
      if (fifths == nullptr) {
        set_nibble(dst + F::kValues, kk, c, q);
        continue;
      }
      set_five(dst, kk, c, q | (fifths[kk] >> sub & 1) << 4);
    }
  }
}

// The KV cache's element types (CacheDtype), 8 elements widened to float32 exactly. A cache in bfloat16 or
// float16 holds each key and value rounded once as it was stored (to nearest even: torch's Tensor.to in
// paged_attention, decoder.cpp's store); attention reads them widened, the same values whichever step wrote
// them, so a token's output still depends on its own request alone.
struct CacheF32 {
  using Element = float;
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
};
struct CacheBF16 {
  using Element = uint16_t;
  static __m256 load8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
};
struct CacheF16 {
  using Element = uint16_t;
  static __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
};

// The query heads attend_group takes at once: a KV head's group runs in chunks of at most this many.
constexpr int kGroupChunk = (int)sluice::kAttendScoreRows;
#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif
// Keys a score pass over H heads takes at once: four (four independent chains a head hide the FMA latency)
// where their 4 x H accumulators, the 4 keys and a query vector fit the registers, else two; and head-dim
// vectors a value pass over H heads sums at once: as many as fit beside the H broadcast weights and the value
// vector, at most 8. Accumulators that do not fit go to memory, a load and a store each multiply-add.
template <int H>
constexpr int kScoreKeys = 4 * H + 5 <= kVectorRegisters ? 4 : 2;
template <int H>
constexpr int kValueVecs = std::min(8, (kVectorRegisters - H - 1) / H);

// The keys' rows (and values') asked of memory this many keys before they are read: a pass serving several
// heads has so much arithmetic a key that the processor's own look-ahead reaches only a few keys ahead.
constexpr int64_t kAheadKeys = 16;
inline void prefetch_row(const void* row, int64_t bytes, int64_t later_bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch((const char*)row + line, _MM_HINT_T0);
  for (int64_t line = bytes; line < later_bytes; line += 64) _mm_prefetch((const char*)row + line, _MM_HINT_T1);
}

// out[h] (h < H, head_dim apart) = inverse[h] * sum over the window's keys i of scores[h][i] * value i, each
// lane's sum in i order, for head-dim vectors [d0, d0 + Vecs): one pass over the values serves the H heads.
// The first pass (d0 0) asks for `ahead` elements of each value's slot from the head's row on.
template <class C, int H, int Vecs, class E = typename C::Element>
void weigh_values(int64_t d0, const E* v_cache, int64_t slot_stride, const int64_t* table, int64_t block_size,
                  int64_t first, int64_t count, const float* scores, int64_t scores_stride, const float* inverse,
                  int64_t head_dim, int64_t ahead, float* out) {
  const int64_t ahead_bytes = (d0 == 0 ? std::max<int64_t>(ahead, Vecs * 8) : Vecs * 8) * (int64_t)sizeof(E);
  __m256 acc[H][Vecs];
  for (int h = 0; h < H; ++h)
    for (int d = 0; d < Vecs; ++d) acc[h][d] = _mm256_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t j = first + i;
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const E* value = v_cache + slot * slot_stride + d0 * 8;
    if (i + kAheadKeys < count) {
      const int64_t later = first + i + kAheadKeys;
      prefetch_row(v_cache + (table[later / block_size] * block_size + later % block_size) * slot_stride + d0 * 8,
                   Vecs * 8 * (int64_t)sizeof(E), ahead_bytes);
    }
    __m256 p[H];
    for (int h = 0; h < H; ++h) p[h] = _mm256_set1_ps(scores[h * scores_stride + i]);
#pragma GCC unroll 8
    for (int d = 0; d < Vecs; ++d) {
      const __m256 v = C::load8(value + d * 8);
      for (int h = 0; h < H; ++h) acc[h][d] = _mm256_fmadd_ps(p[h], v, acc[h][d]);
    }
  }
  for (int h = 0; h < H; ++h) {
    const __m256 norm = _mm256_set1_ps(inverse[h]);
    for (int d = 0; d < Vecs; ++d) _mm256_storeu_ps(out + h * head_dim + (d0 + d) * 8, _mm256_mul_ps(acc[h][d], norm));
  }
}

// H query heads q[h] (head_dim apart) of one KV head over keys [first, n) of their request: all n of them, or
// with a sliding window only the last ones, into out[h]. `softcap` > 0 caps each score at softcap * tanh(score /
// softcap) (Gemma 2); sinks[h] (sinks null: none) is a learned logit that joins the softmax's max and
// denominator without a value (gpt-oss), so the weights of the keys sum to less than one. The heads share each
// pass over the keys and the values, which a step's keys come from memory for: each head's arithmetic is
// its own, in the same order, whatever heads it shares the passes with. The passes ask for `ahead` (at least
// head_dim) elements of each key's and value's slot from the head's row on, kAheadKeys keys before they read it.
template <class C, int H, class E = typename C::Element>
void attend_group(const float* q, int64_t head_dim, const E* k_cache, const E* v_cache, int64_t slot_stride,
                  const int64_t* table, int64_t block_size, int64_t first, int64_t n, float scale, float softcap,
                  const float* sinks, int64_t ahead, float* scores, int64_t scores_stride, float* out) {
  const int64_t vecs = head_dim / 8;
  // Key i of the window (position first + i) and its score for head h, scores[h * scores_stride + i].
  const int64_t count = n - first;
  auto key_at = [&](int64_t i) {
    const int64_t j = first + i;
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    return k_cache + slot * slot_stride;
  };
  // Scores kScoreKeys keys at a time: each key's chain is the same whichever group it falls in.
  constexpr int kKeys = kScoreKeys<H>;
  float best[H];
  for (int h = 0; h < H; ++h) best[h] = -INFINITY;
  int64_t j = 0;
  for (; j + kKeys <= count; j += kKeys) {
    for (int i = 0; i < kKeys; ++i)
      if (j + kAheadKeys + i < count) prefetch_row(key_at(j + kAheadKeys + i), head_dim * (int64_t)sizeof(E), ahead * (int64_t)sizeof(E));
    const E* keys[kKeys];
    for (int i = 0; i < kKeys; ++i) keys[i] = key_at(j + i);
    __m256 acc[H][kKeys];
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < kKeys; ++i) acc[h][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < vecs; ++d) {
      __m256 k[kKeys];
#pragma GCC unroll 4
      for (int i = 0; i < kKeys; ++i) k[i] = C::load8(keys[i] + d * 8);
      for (int h = 0; h < H; ++h) {
        const __m256 query = _mm256_loadu_ps(q + h * head_dim + d * 8);
#pragma GCC unroll 4
        for (int i = 0; i < kKeys; ++i) acc[h][i] = _mm256_fmadd_ps(query, k[i], acc[h][i]);
      }
    }
    for (int h = 0; h < H; ++h)
#pragma GCC unroll 4
      for (int i = 0; i < kKeys; ++i) {
        scores[h * scores_stride + j + i] = hsum(acc[h][i]) * scale;
        best[h] = std::max(best[h], scores[h * scores_stride + j + i]);
      }
  }
  for (; j < count; ++j) {
    const E* key = key_at(j);
    for (int h = 0; h < H; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < vecs; ++d)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * head_dim + d * 8), C::load8(key + d * 8), acc);
      scores[h * scores_stride + j] = hsum(acc) * scale;
      best[h] = std::max(best[h], scores[h * scores_stride + j]);
    }
  }
  float inverse[H];
  const int64_t padded = (count + 7) / 8 * 8;
  for (int h = 0; h < H; ++h) {
    float* head_scores = scores + h * scores_stride;
    if (softcap > 0.0f) {
      // Scalar tanhf: libm's, the same bits for the same score wherever it sits in the batch.
      best[h] = -INFINITY;
      for (int64_t i = 0; i < count; ++i) {
        head_scores[i] = softcap * tanhf(head_scores[i] / softcap);
        best[h] = std::max(best[h], head_scores[i]);
      }
    }
    const float sink = sinks == nullptr ? -INFINITY : sinks[h];
    best[h] = std::max(best[h], sink);
    for (int64_t i = count; i < padded; ++i) head_scores[i] = -INFINITY;
    const __m256 top = _mm256_set1_ps(best[h]);
    __m256 total = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) {
      const __m256 s = _mm256_loadu_ps(head_scores + i);
      // Padding lanes are -inf: zero them rather than trust exp's clamp.
      const __m256 real = _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(s, top)), real);
      _mm256_storeu_ps(head_scores + i, p);
      total = _mm256_add_ps(total, p);
    }
    float sum = hsum(total);
    if (sink != -INFINITY) sum += expf(sink - best[h]);
    inverse[h] = 1.0f / sum;
  }
  // The head dim's vectors kValueVecs<H> a pass, then what is left in passes of 4, 2 and 1.
  constexpr int kWidest = kValueVecs<H>;
  int64_t d0 = 0;
  auto pass = [&](auto width) {
    constexpr int kWidth = decltype(width)::value;
    weigh_values<C, H, kWidth>(d0, v_cache, slot_stride, table, block_size, first, count, scores, scores_stride,
                               inverse, head_dim, ahead, out);
    d0 += kWidth;
  };
  while (d0 + kWidest <= vecs) pass(std::integral_constant<int, kWidest>{});
  if (kWidest > 4 && d0 + 4 <= vecs) pass(std::integral_constant<int, 4>{});
  if (kWidest > 2 && d0 + 2 <= vecs) pass(std::integral_constant<int, 2>{});
  if (d0 < vecs) pass(std::integral_constant<int, 1>{});
}

// `heads` query heads of one KV head, in chunks of kGroupChunk (sluice::attend_heads).
template <class C, class E = typename C::Element>
void attend_kv_group(int64_t heads, const float* q, int64_t head_dim, const E* k_cache, const E* v_cache,
                     int64_t slot_stride, const int64_t* table, int64_t block_size, int64_t first, int64_t n,
                     float scale, float softcap, const float* sinks, int64_t ahead, float* scores, float* out) {
  const int64_t stride = n - first + 8;
  for (int64_t h0 = 0; h0 < heads; h0 += kGroupChunk) {
    const float* chunk_sinks = sinks == nullptr ? nullptr : sinks + h0;
    const float* chunk_q = q + h0 * head_dim;
    float* chunk_out = out + h0 * head_dim;
    auto run = [&](auto chunk) {
      attend_group<C, decltype(chunk)::value>(chunk_q, head_dim, k_cache, v_cache, slot_stride, table, block_size,
                                              first, n, scale, softcap, chunk_sinks, ahead, scores, stride,
                                              chunk_out);
    };
    switch (std::min<int64_t>(kGroupChunk, heads - h0)) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      default: run(std::integral_constant<int, 4>{}); break;
    }
  }
}

// Rows rows[i] (all N where rows is null) of the weight [N, K] widened, into w[i].
template <class F>
void unpack_panels(const uint8_t* wp, int64_t count, int64_t k_dim, const int64_t* rows, float* w) {
#pragma omp parallel for if (count > 64)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = rows == nullptr ? i : rows[i];
    const uint8_t* panel = wp + (n / kPanel) * panel_bytes<F>(k_dim);
    for (int64_t k = 0; k < k_dim; ++k)
      w[i * k_dim + k] = F::scalar(panel, k, (int)(n % kPanel));
  }
}

// Calls run(F{}) with `form`'s struct F.
template <class Run>
void with_form(int64_t form, Run run) {
  switch (form) {
    case kF32: run(F32{}); break;
    case kBF16: run(BF16{}); break;
    case kF16: run(F16{}); break;
    case kQ8_0: run(Q8_0{}); break;
    case kQ8_F32: run(Q8_F32{}); break;
    case kQ8_F32_16: run(Q8_F32_16{}); break;
    case kQ4_1: run(Q4_1{}); break;
    case kQ5_0: run(Q5_0{}); break;
    case kQ5_1: run(Q5_1{}); break;
    case kQ4_K: run(Q4_K{}); break;
    case kQ5_K: run(Q5_K{}); break;
    case kQ6_K: run(Q6_K{}); break;
    case kQ2_K: run(Q2_K{}); break;
    // The Python side names only these forms; any other is a bug there, not an input to serve.
    default: abort();
  }
}

}  // namespace

namespace sluice {

void linear_columns(int64_t form, bool scalar, const float* x, int64_t m_dim, int64_t k_dim, const uint8_t* wp,
                    int64_t n_dim, float* y, int64_t p_first, int64_t p_last) {
  with_form(form, [&](auto f) {
    linear_panels<decltype(f)>(scalar, x, m_dim, k_dim, wp, n_dim, y, nullptr, p_first, p_last);
  });
}

void attend_heads(int64_t cache_dtype, int64_t heads, const float* q, int64_t head_dim, const void* k_cache,
                  const void* v_cache, int64_t slot_stride, const int64_t* table, int64_t block_size, int64_t first,
                  int64_t n, float scale, float softcap, const float* sinks, int64_t ahead, float* scores,
                  float* out) {
  switch (cache_dtype) {
    case kCacheF32:
      attend_kv_group<CacheF32>(heads, q, head_dim, (const float*)k_cache, (const float*)v_cache, slot_stride,
                                table, block_size, first, n, scale, softcap, sinks, ahead, scores, out);
      break;
    case kCacheBF16:
      attend_kv_group<CacheBF16>(heads, q, head_dim, (const uint16_t*)k_cache, (const uint16_t*)v_cache,
                                 slot_stride, table, block_size, first, n, scale, softcap, sinks, ahead, scores, out);
      break;
    case kCacheF16:
      attend_kv_group<CacheF16>(heads, q, head_dim, (const uint16_t*)k_cache, (const uint16_t*)v_cache,
                                slot_stride, table, block_size, first, n, scale, softcap, sinks, ahead, scores, out);
      break;
  }
}

}  // namespace sluice

extern "C" {

// The variant this library was built as (KernelVariant in native.py).
const char* sl_variant() { return SL_VARIANT; }

// Bytes of a weight [N, K] packed in `form`, for sl_pack; 0 where K does not suit the form.
int64_t sl_packed_bytes(int64_t form, int64_t n_dim, int64_t k_dim) {
  int64_t bytes = 0;
  with_form(form, [&](auto f) {
    using F = decltype(f);
    if (k_dim % F::kBlock == 0) bytes = (n_dim + kPanel - 1) / kPanel * panel_bytes<F>(k_dim);
  });
  return bytes;
}

// W [N, K] in its source's layout (float32, bfloat16 or float16 row-major; GGUF blocks, each row K / F::kBlock of
// them) -> wp, sl_packed_bytes(form, N, K) bytes of 16-column panels.
void sl_pack(int64_t form, const void* w, int64_t n_dim, int64_t k_dim, uint8_t* wp) {
  // wp has sl_packed_bytes' size, 0 for a K the form does not take: nothing may be written then.
  if (sl_packed_bytes(form, n_dim, k_dim) == 0) return;
  const uint8_t* src = (const uint8_t*)w;
  switch (form) {
    case kF32:
      pack_panels<F32>(n_dim, k_dim, wp, [&](int64_t n, int64_t k, uint8_t* panel) {
        memcpy(panel + F32::offset(k) + n % kPanel * 4, src + (n * k_dim + k) * 4, 4);
      });
      break;
    case kBF16:
      pack_panels<BF16>(n_dim, k_dim, wp, [&](int64_t n, int64_t k, uint8_t* panel) {
        memcpy(panel + BF16::offset(k) + n % kPanel * 2, src + (n * k_dim + k) * 2, 2);
      });
      break;
    case kF16:
      pack_panels<F16>(n_dim, k_dim, wp, [&](int64_t n, int64_t k, uint8_t* panel) {
        memcpy(panel + F16::offset(k) + n % kPanel * 2, src + (n * k_dim + k) * 2, 2);
      });
      break;
    case kQ8_0:
      // A block: d (fp16), then 32 int8.
      pack_int8s<Q8_0>(n_dim, k_dim, src, wp);
      break;
    case kQ8_F32:
      // A block: d (float32), then 32 int8.
      pack_int8s<Q8_F32>(n_dim, k_dim, src, wp);
      break;
    case kQ8_F32_16:
      // A block: d (float32), then 16 int8.
      pack_int8s<Q8_F32_16>(n_dim, k_dim, src, wp);
      break;
    case kQ4_1:
      // A block: d, m (fp16), then 16 bytes: weight j in byte j's low nibble, weight j + 16 in its high one.
      pack_panels<Q4_1>(n_dim, k_dim, wp, [&](int64_t n, int64_t g, uint8_t* panel) {
        const uint8_t* block = src + (n * (k_dim / 32) + g) * 20;
        uint8_t* dst = panel + Q4_1::offset(g);
        const int c = (int)(n % kPanel);
        memcpy(dst + c * 2, block, 2);
        memcpy(dst + kPanel * 2 + c * 2, block + 2, 2);
        for (int kk = 0; kk < 32; ++kk) {
          const uint8_t q = kk < 16 ? block[4 + kk] & 15 : block[4 + kk - 16] >> 4;
          set_nibble(dst + kPanel * 4, kk, c, q);
        }
      });
      break;
    case kQ5_0:
      // A block: d (fp16), 4 bytes of fifth bits, 16 of nibbles (pack_fives).
      pack_panels<Q5_0>(n_dim, k_dim, wp, [&](int64_t n, int64_t g, uint8_t* panel) {
        pack_fives<false>(src + (n * (k_dim / 32) + g) * 22, (int)(n % kPanel), panel + Q5_0::offset(g));
      });
      break;
    case kQ5_1:
      // Q5_0's block with m (fp16) after d.
      pack_panels<Q5_1>(n_dim, k_dim, wp, [&](int64_t n, int64_t g, uint8_t* panel) {
        pack_fives<true>(src + (n * (k_dim / 32) + g) * 24, (int)(n % kPanel), panel + Q5_1::offset(g));
      });
      break;
    case kQ4_K:
      // A block: d, dmin (fp16), 12 bytes of scales and mins, 128 bytes of nibbles (pack_min_scaled).
      pack_panels<Q4_K>(n_dim, k_dim, wp, [&](int64_t n, int64_t b, uint8_t* panel) {
        pack_min_scaled<Q4_K>(src + (n * (k_dim / 256) + b) * 144, 16, nullptr, (int)(n % kPanel), panel, b);
      });
      break;
    case kQ5_K:
      // Q4_K's block with 32 bytes of fifth bits before the nibbles.
      pack_panels<Q5_K>(n_dim, k_dim, wp, [&](int64_t n, int64_t b, uint8_t* panel) {
        const uint8_t* block = src + (n * (k_dim / 256) + b) * 176;
        pack_min_scaled<Q5_K>(block, 48, block + 16, (int)(n % kPanel), panel, b);
      });
      break;
    case kQ6_K:
      // A block: 128 bytes of the low 4 bits of q + 32 (weight 128h + 64s + j in byte 64h + j, s = 0 its low
      // nibble, 1 its high one), 64 bytes of the high 2 bits (weight 128h + 32t + j at bits 2t of byte
      // 32h + j), 16 int8 scales (one per 16 weights), d (fp16). q's two's complement differs from q + 32 in
      // its top bit alone.
      pack_panels<Q6_K>(n_dim, k_dim, wp, [&](int64_t n, int64_t b, uint8_t* panel) {
        const uint8_t* block = src + (n * (k_dim / 256) + b) * 210;
        const int c = (int)(n % kPanel);
        memcpy(panel + Q6_K::header(b * 16) + c * 2, block + 208, 2);
        for (int i = 0; i < 256; ++i) {
          const int h = i / 128, r = i % 128, kk = i % 16;
          uint8_t* dst = panel + Q6_K::offset(b * 16 + i / 16);
          if (kk == 0) dst[Q6_K::kScales + c] = block[192 + i / 16];
          const int low = block[h * 64 + r % 64] >> (r / 64 * 4) & 15;
          const int high = block[128 + h * 32 + r % 32] >> (r / 32 * 2) & 3;
          uint16_t window;
          memcpy(&window, dst + kk * 12 + 6 * c / 8, 2);
          window |= (uint16_t)((low | high << 4) ^ 32) << (6 * c % 8);
          memcpy(dst + kk * 12 + 6 * c / 8, &window, 2);
        }
      });
      break;
    case kQ2_K:
      // A block: 16 bytes of scales (sub-block s's sc in byte s's low nibble, its m in the high one), 64 bytes
      // of q (weight 128h + 32t + j's 2 bits at bits 2t of byte 32h + j), d, dmin (fp16). Its 2-bit values
      // go into the panel as nibbles.
      pack_panels<Q2_K>(n_dim, k_dim, wp, [&](int64_t n, int64_t b, uint8_t* panel) {
        const uint8_t* block = src + (n * (k_dim / 256) + b) * 84;
        const int c = (int)(n % kPanel);
        uint8_t* head = panel + Q2_K::header(b * 16);
        memcpy(head + c * 2, block + 80, 2);
        memcpy(head + kPanel * 2 + c * 2, block + 82, 2);
        for (int sub = 0; sub < 16; ++sub) {
          uint8_t* dst = panel + Q2_K::offset(b * 16 + sub);
          dst[Q2_K::kScales + c] = block[sub] & 15;
          dst[Q2_K::kScales + kPanel + c] = block[sub] >> 4;
          for (int kk = 0; kk < 16; ++kk) {
            const int i = sub * 16 + kk, h = i / 128, t = i % 128 / 32, j = i % 32;
            set_nibble(dst + Q2_K::kValues, kk, c, block[16 + h * 32 + j] >> (2 * t) & 3);
          }
        }
      });
      break;
  }
}

// w [N, K] float32: the values the kernel widens a packed weight to, for the loader to check a form
// against the float32 weight it stands for.
void sl_unpack(int64_t form, const uint8_t* wp, int64_t n_dim, int64_t k_dim, float* w) {
  with_form(form, [&](auto f) { unpack_panels<decltype(f)>(wp, n_dim, k_dim, nullptr, w); });
}

// w [count, K] float32: rows[i] of a packed weight [N, K] widened (a tied output head read back as its input
// embedding); 0, or -1 with nothing written where a row is outside [0, N).
int64_t sl_unpack_rows(int64_t form, const uint8_t* wp, int64_t n_dim, int64_t k_dim, const int64_t* rows,
                       int64_t count, float* w) {
  for (int64_t i = 0; i < count; ++i)
    if (rows[i] < 0 || rows[i] >= n_dim) return -1;
  with_form(form, [&](auto f) { unpack_panels<decltype(f)>(wp, count, k_dim, rows, w); });
  return 0;
}

// y[M, N] = x[M, K] @ W.T, W packed by sl_pack in `form`; block_max as `linear` says. `scalar` runs the
// portable variant (the same bits, slower).
void sl_linear(int64_t form, int64_t scalar, const float* x, int64_t m_dim, int64_t k_dim, const uint8_t* wp,
               int64_t n_dim, float* y, float* block_max) {
  with_form(form, [&](auto f) { linear<decltype(f)>(scalar, x, m_dim, k_dim, wp, n_dim, y, block_max); });
}

// Experts' linear layers over rows grouped by expert: counts[e] rows of x for expert e, in expert order,
// each expert's weight packed by sl_pack in `form` at panels + e * expert_bytes. A row's arithmetic is
// sl_linear's, so its result depends on its own input and expert alone, not on how many rows share it; all
// the experts run in one parallel region (grouped_linear).
void sl_grouped_linear(int64_t form, int64_t scalar, const float* x, int64_t k_dim, const int64_t* counts,
                       int64_t num_experts, const uint8_t* panels, int64_t expert_bytes, int64_t n_dim, float* y) {
  with_form(form, [&](auto f) {
    grouped_linear<decltype(f)>(scalar, x, k_dim, counts, num_experts, panels, expert_bytes, n_dim, y);
  });
}

// out[T, H, D]: query t, head h attends to the first context_lens[t] keys of the request
// whose block table is block_tables[table_rows[t]], in the layer's cache [slots, KVH, D] of elements
// `cache_dtype` (CacheDtype in invariant.h); with
// window > 0 only to the last `window` of them (positions (p - window, p] for the query at p).
// key_ends (else null) lets a query read past itself, to key_ends[t] (an image's tokens that see their
// whole image: Gemma 3); a window still starts from its own position, context_lens[t] - window.
// softcap > 0 caps the scores (attend); sinks (else null) holds a logit per query head.
void sl_paged_attention(const float* q, int64_t num_tokens, int64_t num_heads, int64_t head_dim, int64_t cache_dtype,
                        const void* k_cache, const void* v_cache, int64_t num_kv_heads,
                        const int64_t* block_tables, int64_t table_width, int64_t block_size,
                        const int64_t* table_rows, const int64_t* context_lens, const int64_t* key_ends,
                        float scale, int64_t window, float softcap, const float* sinks, float* out) {
  auto first_key = [&](int64_t t) { return window > 0 ? std::max<int64_t>(0, context_lens[t] - window) : 0; };
  auto key_end = [&](int64_t t) { return key_ends == nullptr ? context_lens[t] : key_ends[t]; };
  int64_t longest = 0;
  for (int64_t t = 0; t < num_tokens; ++t) longest = std::max(longest, key_end(t) - first_key(t));
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  const int64_t element_bytes = cache_dtype == sluice::kCacheF32 ? 4 : 2;
#pragma omp parallel
  {
    std::vector<float> scores(sluice::kAttendScoreRows * (longest + 8));
    // One item per token and KV head: the query heads that share the KV head share its passes over the keys
    // and values. With tokens enough a thread takes a token's KV heads together (sluice::slot_heads).
    const int64_t chunk = sluice::slot_heads(num_tokens, num_kv_heads, omp_get_num_threads());
#pragma omp for schedule(dynamic, chunk)
    for (int64_t item = 0; item < num_tokens * num_kv_heads; ++item) {
      const int64_t t = item / num_kv_heads, kv = item % num_kv_heads;
      const int64_t n = key_end(t), first = first_key(t);
      const int64_t offset = (t * num_heads + kv * group) * head_dim;
      sluice::attend_heads(cache_dtype, group, q + offset, head_dim,
                           (const char*)k_cache + kv * head_dim * element_bytes,
                           (const char*)v_cache + kv * head_dim * element_bytes, slot_stride,
                           block_tables + table_rows[t] * table_width, block_size, first, n, scale, softcap,
                           sinks == nullptr ? nullptr : sinks + kv * group,
                           sluice::slot_ahead(chunk, kv, slot_stride, head_dim), scores.data(), out + offset);
    }
  }
}

}  // extern "C"
