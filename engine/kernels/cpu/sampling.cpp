// The sampler's kernel for CPUs with AVX2 and FMA: one call draws a token for every row of a
// step's float32 logits, with the semantics of engine/sampling/sampler.py.
//
// A greedy row is one argmax. A sampled row is a max pass, one exp pass that also sums each
// 256-token block, and a two-level inverse-CDF draw (the block, then the token inside it). Where the
// output head's kernel gave each block's max (sl_linear), a greedy row reads only the block holding
// its max and a sampled row skips the max pass: no pass over the row's logits just for its max.
// Top-k cuts at the k-th largest weight, found among the weights no lighter than the k-th largest
// block max (a k-heap behind a vector compare where k is more than the blocks); min-p at a floor;
// top-p by rejection with no sort: a drawn token is kept when the mass heavier than it is below
// top_p, otherwise every token as light as it goes and the row draws again. The pass that sums the
// heavier mass stops once the blocks left cannot reach top_p, and when it runs to the end it gives
// the next draw's block sums, so a round is at most one vector pass.
//
// Every reduction of a row runs in an order fixed by that row alone, and the uniforms are the
// counter-based ones of engine/sampling/draws.py, so a row's token never depends on its batch,
// its place in it or the thread that draws it.

#include "intrinsics.h"
#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "vector_math.h"

namespace {

using sluice::exp2_256_nonpositive;
using sluice::hmax;
using sluice::hsum;
using sluice::row_max;

constexpr int64_t kBlock = 256;
// Rejection rounds before the rest of a row's nucleus is found by sorting, as in the torch path
// (rarely reached: each round keeps the drawn token with probability at least top_p).
constexpr uint64_t kMaxRounds = 16;

uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// draws.uniform(key, position, lane), bit for bit.
double uniform(uint64_t key, int64_t position, uint64_t lane) {
  uint64_t x = mix(key + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(position + 1));
  x = mix(x ^ ((lane + 1) * 0xD1B54A32D192ED03ull));
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

// The first index of the largest value, as torch's argmax breaks ties.
int64_t argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == m) return i;
  return 0;
}

// The same, given each block's largest value: only the first block holding the max is read.
int64_t argmax_by_blocks(const float* x, int64_t n, const float* maxima) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  const float m = row_max(maxima, num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (maxima[b] != m) continue;
    for (int64_t i = b * kBlock, end = std::min(n, (b + 1) * kBlock); i < end; ++i)
      if (x[i] == m) return i;
  }
  // Only a NaN gets here (no value equals the max): read the row as torch would.
  return argmax(x, n);
}

__m256i tail_mask(int64_t left) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), lanes);
}

// w = exp((x - m) * inverse_t), as 2^((x - m) * inverse_t * log2(e)), zero below 2^-125 and past n
// (w holds n rounded up to 8); returns the row's mass and leaves each block's float sum in `blocks`,
// and with kBlockMax each block's largest weight in `block_max` (for top-k; one max a vector).
template <bool kBlockMax>
double exp_pass(const float* x, int64_t n, float m, float inverse_t, float* w, float* blocks, float* block_max) {
  const __m256 top = _mm256_set1_ps(m);
  const __m256 scale = _mm256_set1_ps(static_cast<float>(static_cast<double>(inverse_t) * 1.4426950408889634));
  const __m256 lowest = _mm256_set1_ps(-125.0f);
  // The max is subtracted before the temperature multiplies, so the best token's weight is exactly 1.
  // Every t is <= 0 (or NaN), and the lanes below 2^-125 are zeroed, so 2^t needs no clamp.
  auto weight = [&](__m256 v) {
    const __m256 t = _mm256_mul_ps(_mm256_sub_ps(v, top), scale);
    return _mm256_and_ps(exp2_256_nonpositive(t), _mm256_cmp_ps(t, lowest, _CMP_GE_OQ));
  };
  double total = 0.0;
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    const int64_t end = std::min(start + kBlock, n);
    __m256 acc = _mm256_setzero_ps(), odd = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    int64_t i = start;
    // Two vectors per round, summed apart (even and odd vectors, joined at the block's end): the
    // out-of-order core gets two exp chains at once and no add waits on the one before it.
    for (; i + 16 <= end; i += 16) {
      const __m256 e0 = weight(_mm256_loadu_ps(x + i)), e1 = weight(_mm256_loadu_ps(x + i + 8));
      _mm256_storeu_ps(w + i, e0);
      _mm256_storeu_ps(w + i + 8, e1);
      acc = _mm256_add_ps(acc, e0);
      odd = _mm256_add_ps(odd, e1);
      if constexpr (kBlockMax) high = _mm256_max_ps(high, _mm256_max_ps(e0, e1));
    }
    acc = _mm256_add_ps(acc, odd);
    for (; i < end; i += 8) {
      const __m256i lanes = tail_mask(end - i);
      const __m256 e = _mm256_and_ps(weight(_mm256_maskload_ps(x + i, lanes)), _mm256_castsi256_ps(lanes));
      _mm256_storeu_ps(w + i, e);
      acc = _mm256_add_ps(acc, e);
      if constexpr (kBlockMax) high = _mm256_max_ps(high, e);
    }
    blocks[b] = hsum(acc);
    if constexpr (kBlockMax) block_max[b] = hmax(high);
    total += blocks[b];
  }
  return total;
}

// The float sum of w[start, end)'s weights >= lo, in exp_pass's order, so the same weights give
// the same sum (and a floor can only lower it: every partial sum is rounded from smaller terms).
float block_sum(const float* w, int64_t start, int64_t end, float lo) {
  const __m256 floor = _mm256_set1_ps(lo);
  auto kept = [&](int64_t i) {
    const __m256 v = _mm256_loadu_ps(w + i);
    return _mm256_and_ps(v, _mm256_cmp_ps(v, floor, _CMP_GE_OQ));
  };
  __m256 acc = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  int64_t i = start;
  for (; i + 16 <= end; i += 16) {
    acc = _mm256_add_ps(acc, kept(i));
    odd = _mm256_add_ps(odd, kept(i + 8));
  }
  acc = _mm256_add_ps(acc, odd);
  for (; i < end; i += 8) acc = _mm256_add_ps(acc, kept(i));
  return hsum(acc);
}

// Each block's float sum of the weights >= lo, and the row's mass (their sum, in block order).
// Given each block's largest weight, the blocks with none >= lo are not read: their sum is 0.
double block_sums(const float* w, int64_t n, float lo, float* blocks, const float* block_max = nullptr) {
  double total = 0.0;
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    const bool empty = block_max != nullptr && block_max[b] < lo;
    blocks[b] = empty ? 0.0f : block_sum(w, start, std::min(start + kBlock, n), lo);
    total += blocks[b];
  }
  return total;
}

// Whether the mass of the weights >= lo is below `target`, as block_sums would sum it, reading only
// as many blocks as it takes: `bounds` holds each block's sum at a lower floor, so the blocks not
// yet read can add at most theirs (with a margin far above the doubles' rounding). A mass not
// below comes out of a full pass, so `blocks` then holds block_sums's sums at lo.
bool mass_below(const float* w, int64_t n, float lo, double target, const float* bounds, float* blocks) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  double unread = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) unread += bounds[b];
  const double margin = 1e-9 * unread;
  double total = 0.0;
  bool below = false;
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    // A block with nothing at the lower floor has nothing at this one.
    blocks[b] = bounds[b] > 0.0f ? block_sum(w, start, std::min(start + kBlock, n), lo) : 0.0f;
    total += blocks[b];
    unread -= bounds[b];
    if (total + unread + margin < target) {
      below = true;
      break;
    }
  }
  // Summed to the end: decided exactly as block_sums's total would be (the heaviest token, with
  // nothing heavier, is always in the nucleus).
  return below || total < target || total <= 0.0;
}

// The k-th largest weight (0 < k < n): a min-heap of the k largest so far, and a vector compare
// that skips the eight-token groups with nothing above its smallest.
float kth_largest(const float* w, int64_t n, int64_t k, std::vector<float>& heap) {
  heap.assign(w, w + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  float smallest = heap.front();
  auto consider = [&](float v) {
    if (v <= smallest) return;
    std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
    heap.back() = v;
    std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    smallest = heap.front();
  };
  int64_t i = k;
  for (; i < n && i % 8; ++i) consider(w[i]);
  for (; i + 8 <= n; i += 8) {
    int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + i), _mm256_set1_ps(smallest), _CMP_GT_OQ));
    for (; bits; bits &= bits - 1) consider(w[i + __builtin_ctz(bits)]);
  }
  for (; i < n; ++i) consider(w[i]);
  return smallest;
}

// The same for k no more than the blocks, given each block's largest weight: the k blocks with the
// largest hold k weights at least as large as the k-th of them, so only the weights that large can
// be the k-th largest, and only the blocks whose max is that large hold any.
float kth_largest_by_blocks(const float* w, int64_t n, int64_t k, const float* block_max, int64_t num_blocks,
                            std::vector<float>& values) {
  values.assign(block_max, block_max + num_blocks);
  std::nth_element(values.begin(), values.begin() + k - 1, values.end(), std::greater<float>());
  const float lo = values[k - 1];
  const __m256 floor = _mm256_set1_ps(lo);
  values.clear();
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (block_max[b] < lo) continue;
    // w holds n rounded up to 8, zero past n, and lo is a block's max weight, so above zero.
    for (int64_t i = b * kBlock, end = std::min(n, (b + 1) * kBlock); i < end; i += 8) {
      int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + i), floor, _CMP_GE_OQ));
      for (; bits; bits &= bits - 1) values.push_back(w[i + __builtin_ctz(bits)]);
    }
  }
  std::nth_element(values.begin(), values.begin() + k - 1, values.end(), std::greater<float>());
  return values[k - 1];
}

// One token among the weights >= lo by inverse CDF at u: the block whose running mass passes
// u x total, then the token inside it; rounding past the end takes the last token with weight.
int64_t draw(const float* w, int64_t n, const float* blocks, int64_t num_blocks, float lo, double u) {
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) total += blocks[b];
  const double target = u * total;
  double before = 0.0;
  int64_t block = -1, last_block = -1;
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (blocks[b] <= 0.0f) continue;
    last_block = b;
    if (before + blocks[b] > target) {
      block = b;
      break;
    }
    before += blocks[b];
  }
  if (block < 0) block = last_block;
  if (block < 0) return 0;
  const double rest = target - before;
  double running = 0.0;
  int64_t last = -1;
  for (int64_t i = block * kBlock, end = std::min(n, (block + 1) * kBlock); i < end; ++i) {
    if (w[i] < lo || w[i] <= 0.0f) continue;
    last = i;
    running += w[i];
    if (running > rest) return i;
  }
  return last < 0 ? 0 : last;
}

// The lightest weight still in the nucleus of the weights >= lo: every token whose heavier
// mass is below `target`. By sorting; only for rows the rejection rounds left undecided.
float nucleus_floor(const float* w, int64_t n, float lo, double target, std::vector<float>& values) {
  values.clear();
  for (int64_t i = 0; i < n; ++i)
    if (w[i] >= lo && w[i] > 0.0f) values.push_back(w[i]);
  std::sort(values.begin(), values.end(), std::greater<float>());
  double heavier = 0.0;
  float floor = values.empty() ? lo : values.front();
  for (size_t i = 0; i < values.size() && heavier < target;) {
    floor = values[i];
    for (const float value = values[i]; i < values.size() && values[i] == value; ++i) heavier += values[i];
  }
  return floor;
}

struct Workspace {
  std::vector<float> weights, blocks, bounds, scratch;
};

// `maxima`: each block's largest value of x, where the output head's kernel gave them (else null).
int64_t sample_row(const float* x, int64_t n, const float* maxima, float inverse_t, int64_t top_k, float top_p,
                   float min_p, uint64_t key, int64_t position, Workspace& space) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  if (inverse_t <= 0.0f) return maxima != nullptr ? argmax_by_blocks(x, n, maxima) : argmax(x, n);
  const float m = maxima != nullptr ? row_max(maxima, num_blocks) : row_max(x, n);
  if (m == -INFINITY) return 0;
  space.weights.resize((n + 7) / 8 * 8);
  space.blocks.resize(num_blocks);
  space.bounds.resize(num_blocks);
  float* w = space.weights.data();
  float* blocks = space.blocks.data();
  float* bounds = space.bounds.data();
  const bool cuts_top_k = top_k > 0 && top_k < n;
  // A top-k row's block maxima go to `bounds`, free until the nucleus test.
  const bool by_blocks = cuts_top_k && top_k <= num_blocks;
  double mass = by_blocks ? exp_pass<true>(x, n, m, inverse_t, w, blocks, bounds)
                          : exp_pass<false>(x, n, m, inverse_t, w, blocks, nullptr);
  // Order as in vLLM: top-k, then top-p over what top-k kept, then min-p (of the best token's
  // weight, which is 1).
  float lo = 0.0f;
  if (cuts_top_k) {
    lo = by_blocks ? kth_largest_by_blocks(w, n, top_k, bounds, num_blocks, space.scratch)
                   : kth_largest(w, n, top_k, space.scratch);
    mass = block_sums(w, n, lo, blocks, by_blocks ? bounds : nullptr);
  }
  const double target = mass * static_cast<double>(top_p);
  if (min_p > lo) {
    lo = min_p;
    block_sums(w, n, lo, blocks);
  }
  uint64_t lane = 0;
  int64_t token = draw(w, n, blocks, num_blocks, lo, uniform(key, position, lane));
  if (top_p >= 1.0f) return token;
  while (true) {
    const float above = nextafterf(w[token], INFINITY);
    // The blocks' sums at lo bound their sums above the drawn token.
    std::copy(blocks, blocks + num_blocks, bounds);
    if (mass_below(w, n, above, target, bounds, blocks)) return token;
    // Outside: it and everything as light are dropped, and the heavier tokens are drawn among.
    lo = above;
    if (++lane == kMaxRounds) {
      lo = nucleus_floor(w, n, lo, target, space.scratch);
      block_sums(w, n, lo, blocks);
      return draw(w, n, blocks, num_blocks, lo, uniform(key, position, lane));
    }
    token = draw(w, n, blocks, num_blocks, lo, uniform(key, position, lane));
  }
}

}  // namespace

// One row's sampling parameters, as engine/kernels/cpu/sampling.py packs them.
struct RowSettings {
  float inverse_t;  // 0: greedy
  float top_p;      // 1: off
  float min_p;      // 0: off
  int64_t top_k;    // 0: off
};
static_assert(sizeof(RowSettings) == 24, "RowSettings must match sampling.py's layout");

extern "C" {

// tokens[r] for each row r of logits [rows, n] (row stride `stride`): argmax where
// settings[r].inverse_t is 0, otherwise a draw at temperature 1 / inverse_t with its top_k, top_p and
// min_p, from the uniforms of (keys[r], positions[r]).
// block_max (else null) holds rows of ceil(n / 256) block maxima from sl_linear: row r's are its row
// r, or with maxima_rows (else null) its row maxima_rows[r], none where that is -1 (logits changed
// since the head computed them).
void sl_sample(const float* logits, int64_t rows, int64_t n, int64_t stride, const RowSettings* settings,
               const uint64_t* keys, const int64_t* positions, const float* block_max, const int64_t* maxima_rows,
               int64_t* tokens) {
  const int64_t num_blocks = (n + kBlock - 1) / kBlock;
  // Rows differ in cost (greedy, rejection rounds): hand them out one at a time.
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    // Per thread and kept across calls: OpenMP's workers live as long as the process.
    static thread_local Workspace space;
    const int64_t maxima_row = maxima_rows != nullptr ? maxima_rows[r] : r;
    const float* maxima = block_max != nullptr && maxima_row >= 0 ? block_max + maxima_row * num_blocks : nullptr;
    const RowSettings& row = settings[r];
    tokens[r] = sample_row(logits + r * stride, n, maxima, row.inverse_t, row.top_k, row.top_p, row.min_p, keys[r],
                           positions[r], space);
  }
}

}  // extern "C"
