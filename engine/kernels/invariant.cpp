// Batch-invariant float32 kernels for x86 CPUs with AVX2 and FMA.
//
// A row's result here depends on that row's inputs alone: every output element is one
// chain of fused multiply-adds in a fixed order (k = 0, 1, ..., K-1 for a linear layer;
// key 0, 1, ..., n-1 for attention), whatever the number of rows, their place in the
// batch, the tile that computes them or the thread that runs the tile. BLAS libraries pick
// kernels and reduction splits by the matrix's shape, so the same token gets different
// bits alone and in a batch; these kernels never do.
//
// Loaded with ctypes (engine/kernels/native.py); OpenMP resolves to the libgomp that
// torch has already loaded, so both share one thread pool.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "vector_math.h"

namespace {

using sluice::exp256;
using sluice::hsum;
using sluice::row_max;

constexpr int kPanel = 16;  // output columns per packed weight panel: two AVX registers
// Columns per block of sl_linear's block maxima: the sampler's block (kBlock in sampling.cpp).
constexpr int64_t kMaxBlock = 256;

// Rows x (panels * 16) outputs, each a k-ordered FMA chain from zero. Every variant does the
// same arithmetic per element; they differ only in how many elements share a pass over k.
template <int Rows, int Panels>
inline void tile(const float* x, int64_t x_stride, const float* wp, int64_t panel_stride, int64_t k_dim,
                 float* y, int64_t y_stride) {
  __m256 acc[Rows][Panels * 2];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < Panels * 2; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __m256 w[Panels * 2];
#pragma GCC unroll 8
    for (int p = 0; p < Panels; ++p) {
      const float* src = wp + p * panel_stride + k * kPanel;
      w[2 * p] = _mm256_loadu_ps(src);
      w[2 * p + 1] = _mm256_loadu_ps(src + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * x_stride + k);
#pragma GCC unroll 8
      for (int c = 0; c < Panels * 2; ++c) acc[r][c] = _mm256_fmadd_ps(a, w[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < Panels * 2; ++c) _mm256_storeu_ps(y + r * y_stride + c * 8, acc[r][c]);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);

// Twelve accumulators fill the sixteen AVX registers best: 6 rows x 1 panel, 3 x 2, 1 x 4.
template <int Rows>
constexpr int panels_for() {
  return Rows >= 4 ? 1 : (Rows >= 2 ? 2 : 4);
}

template <int Rows>
void rows_over_panels(const float* x, int64_t k_dim, const float* wp, int64_t p_begin, int64_t p_end, float* out,
                      int64_t out_stride) {
  constexpr int wide = panels_for<Rows>();
  const int64_t panel_stride = k_dim * kPanel;
  int64_t p = p_begin;
  for (; p + wide <= p_end; p += wide)
    tile<Rows, wide>(x, k_dim, wp + p * panel_stride, panel_stride, k_dim, out + p * kPanel, out_stride);
  for (; p < p_end; ++p)
    tile<Rows, 1>(x, k_dim, wp + p * panel_stride, panel_stride, k_dim, out + p * kPanel, out_stride);
}

void row_block(int rows, const float* x, int64_t k_dim, const float* wp, int64_t p_begin, int64_t p_end, float* out,
               int64_t out_stride) {
  switch (rows) {
    case 1: rows_over_panels<1>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    case 2: rows_over_panels<2>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    case 3: rows_over_panels<3>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    case 4: rows_over_panels<4>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    case 5: rows_over_panels<5>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
    default: rows_over_panels<6>(x, k_dim, wp, p_begin, p_end, out, out_stride); break;
  }
}

// One query head over its request's first `n` keys.
void attend(const float* q, int64_t head_dim, const float* k_cache, const float* v_cache, int64_t slot_stride,
            const int64_t* table, int64_t block_size, int64_t n, float scale, float* scores, float* out) {
  const int64_t vecs = head_dim / 8;
  // Scores four keys at a time: four independent chains hide the FMA latency, and each
  // key's chain is the same whichever group it falls in.
  auto key_at = [&](int64_t j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    return k_cache + slot * slot_stride;
  };
  float best = -INFINITY;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* keys[4] = {key_at(j), key_at(j + 1), key_at(j + 2), key_at(j + 3)};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t d = 0; d < vecs; ++d) {
      const __m256 query = _mm256_loadu_ps(q + d * 8);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(query, _mm256_loadu_ps(keys[i] + d * 8), acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      scores[j + i] = hsum(acc[i]) * scale;
      best = std::max(best, scores[j + i]);
    }
  }
  for (; j < n; ++j) {
    const float* key = key_at(j);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < vecs; ++d)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d * 8), _mm256_loadu_ps(key + d * 8), acc);
    scores[j] = hsum(acc) * scale;
    best = std::max(best, scores[j]);
  }
  const int64_t padded = (n + 7) / 8 * 8;
  for (int64_t j = n; j < padded; ++j) scores[j] = -INFINITY;
  const __m256 top = _mm256_set1_ps(best);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 s = _mm256_loadu_ps(scores + j);
    // Padding lanes are -inf: zero them rather than trust exp's clamp.
    const __m256 real = _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(s, top)), real);
    _mm256_storeu_ps(scores + j, p);
    total = _mm256_add_ps(total, p);
  }
  const float inverse = 1.0f / hsum(total);
  __m256 acc[32];
  for (int64_t d = 0; d < vecs; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const float* value = v_cache + slot * slot_stride;
    const __m256 p = _mm256_set1_ps(scores[j]);
    for (int64_t d = 0; d < vecs; ++d) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + d * 8), acc[d]);
  }
  const __m256 norm = _mm256_set1_ps(inverse);
  for (int64_t d = 0; d < vecs; ++d) _mm256_storeu_ps(out + d * 8, _mm256_mul_ps(acc[d], norm));
}

}  // namespace

extern "C" {

// y[M, N] = x[M, K] @ W.T, with W packed by sl_pack_weight. Threads split the output columns
// (never k); each walks its columns four panels at a time, over every row.
//
// With block_max (else null), also block_max[M, ceil(N / 256)]: the largest value of each row's
// 256-column blocks, taken while the tile is still in L1, so the sampler never reads a whole row of
// logits to find its max. Threads then split the columns at block boundaries, so one thread owns each
// block; every element's arithmetic is the same either way.
void sl_linear(const float* x, int64_t m_dim, int64_t k_dim, const float* wp, int64_t n_dim, float* y,
               float* block_max) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  const int64_t full = n_dim / kPanel;
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
    for (int64_t p_begin = p_first; p_begin < p_last; p_begin += 4) {
      const int64_t p_end = std::min(p_begin + 4, p_last);
      const int64_t p_full = std::min(p_end, full);
      for (int64_t m = 0; m < m_dim; m += 6) {
        const int rows = (int)std::min<int64_t>(6, m_dim - m);
        if (p_begin < p_full) row_block(rows, x + m * k_dim, k_dim, wp, p_begin, p_full, y + m * n_dim, n_dim);
        if (p_full < p_end) {
          // The last panel runs past N: compute it into scratch and keep the real columns.
          float spill[6 * kPanel];
          row_block(rows, x + m * k_dim, k_dim, wp + full * k_dim * kPanel, 0, 1, spill, kPanel);
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
}

// W [N, K] row-major -> panels of 16 output columns, each K x 16, zero-padded past N.
void sl_pack_weight(const float* w, int64_t n_dim, int64_t k_dim, float* wp) {
  const int64_t panels = (n_dim + kPanel - 1) / kPanel;
  memset(wp, 0, panels * k_dim * kPanel * sizeof(float));
  for (int64_t n = 0; n < n_dim; ++n) {
    float* panel = wp + (n / kPanel) * k_dim * kPanel + n % kPanel;
    const float* row = w + n * k_dim;
    for (int64_t k = 0; k < k_dim; ++k) panel[k * kPanel] = row[k];
  }
}

// out[T, H, D]: query t, head h attends to the first context_lens[t] keys of the request
// whose block table is block_tables[table_rows[t]], in the layer's cache [slots, KVH, D].
void sl_paged_attention(const float* q, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                        const float* k_cache, const float* v_cache, int64_t num_kv_heads,
                        const int64_t* block_tables, int64_t table_width, int64_t block_size,
                        const int64_t* table_rows, const int64_t* context_lens, float scale, float* out) {
  int64_t longest = 0;
  for (int64_t t = 0; t < num_tokens; ++t) longest = std::max(longest, context_lens[t]);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
#pragma omp parallel
  {
    std::vector<float> scores(longest + 8);
    // One item per token and KV head: the query heads that share the KV head run back to back
    // on one thread while its keys and values are still in cache.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_tokens * num_kv_heads; ++item) {
      const int64_t t = item / num_kv_heads, kv = item % num_kv_heads;
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        const int64_t offset = (t * num_heads + h) * head_dim;
        attend(q + offset, head_dim, k_cache + kv * head_dim, v_cache + kv * head_dim, slot_stride,
               block_tables + table_rows[t] * table_width, block_size, context_lens[t], scale, scores.data(),
               out + offset);
      }
    }
  }
}

}  // extern "C"
