// What invariant.cpp lends the other kernels (decoder.cpp): its linear layer over a share of the output
// columns, and its attention of one query head, each with the arithmetic of sl_linear and
// sl_paged_attention.

#pragma once

#include <stdint.h>

namespace sluice {

// Panels [p_first, p_last) (16 output columns each) of y[M, N] = x[M, K] @ W.T, W packed by sl_pack in
// `form`, on the calling thread; `scalar`: the portable variant.
void linear_columns(int64_t form, bool scalar, const float* x, int64_t m_dim, int64_t k_dim, const uint8_t* wp,
                    int64_t n_dim, float* y, int64_t p_first, int64_t p_last);

// The KV cache's element type (KVCache's dtype, CACHE_DTYPES in engine/kernels/cpu/invariant.py).
enum CacheDtype : int64_t { kCacheF32 = 0, kCacheBF16 = 1, kCacheF16 = 2 };

// The rows of scores attend_heads needs, each n - first + 8 floats.
constexpr int64_t kAttendScoreRows = 4;

// `heads` query heads q[h] (head_dim apart) that share one KV head, over keys [first, n) of their request, read
// through its block `table` from the layer's caches of `cache_dtype` (slots `slot_stride` elements apart), into
// out[h] (head_dim apart); sinks[h] (sinks null: none) joins head h's softmax; `scores` holds kAttendScoreRows
// * (n - first + 8) floats. Each key's and value's slot is asked of memory `ahead` elements from the head's row
// on (head_dim: its own row; more: the slot's later KV heads too, for their passes next on this thread).
void attend_heads(int64_t cache_dtype, int64_t heads, const float* q, int64_t head_dim, const void* k_cache,
                  const void* v_cache, int64_t slot_stride, const int64_t* table, int64_t block_size, int64_t first,
                  int64_t n, float scale, float softcap, const float* sinks, int64_t ahead, float* scores,
                  float* out);

// The (token, KV head) items a thread takes at once in a step's attention: a token's KV heads together where
// there are tokens enough to share among the threads, so its first head's passes bring in each slot whole
// (its KV heads' rows lie side by side) and the others read it from this core's caches; else one.
inline int64_t slot_heads(int64_t tokens, int64_t kv_heads, int64_t threads) {
  return tokens >= 2 * threads ? kv_heads : 1;
}

// attend_heads' `ahead` for KV head kv of a token taken in items of `chunk` (slot_heads): the whole slot for a
// token's first head where its heads run together, else the head's own row.
inline int64_t slot_ahead(int64_t chunk, int64_t kv, int64_t slot_stride, int64_t head_dim) {
  return chunk > 1 && kv == 0 ? slot_stride : head_dim;
}

}  // namespace sluice
