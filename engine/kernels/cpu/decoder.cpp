// A step's decoder layers in one call: Llama's layer (RMSNorm, q/k/v, rotary, the paged cache's write and
// attention, o, residual, RMSNorm, gate/up, SiLU, down, residual) for every layer, with the bits of the
// layer run op by op in torch with the invariant kernels (engine/model/families/llama.py): the linear
// layers and attention are invariant.cpp's own arithmetic, the norms and SiLU torch's (torch_math.h), the
// rest single roundings in torch's order. A decode step of a small model is otherwise mostly Python: some
// forty torch ops and ctypes calls a layer.
//
// All layers run in one OpenMP parallel region. Threads split each linear layer's output columns (a
// thread's share of q/k/v, of gate/up, of o and down), the attention's (token, KV head) items, and the
// tokens for the norms' and rotary's element-wise work; each thread normalizes the whole input of a
// linear layer into a buffer of its own, so no barrier waits on the norm. The six barriers a layer are
// barrier.h's, which spin a little before they sleep: libgomp's sleep at once under OMP_WAIT_POLICY=PASSIVE.

#include "intrinsics.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "barrier.h"
#include "invariant.h"
#include "torch_math.h"

namespace {

// A packed linear layer (PackedLinear): y = x @ W.T (+ bias).
struct Linear {
  int64_t form;
  const uint8_t* panels;
  int64_t out_features;
  int64_t in_features;
  const float* bias;  // or null
};

// One decoder layer's weights (DecoderLayerWeights in engine/kernels/cpu/decoder.py).
struct Layer {
  const float* input_norm;  // [hidden]
  const float* post_norm;   // [hidden]
  const float* q_norm;      // [head_dim], or null (Qwen3's per-head norms)
  const float* k_norm;
  float input_eps, post_eps, q_eps, k_eps;
  Linear q, k, v, o, gate, up, down;
  int64_t window;  // keys a query reads, itself included; 0: all
};

// What every layer of a step shares (DecoderStep in engine/kernels/cpu/decoder.py).
struct Step {
  int64_t tokens, hidden, heads, kv_heads, head_dim, intermediate;
  float scale;
  int64_t scalar;  // the linear layers' portable variant
  const float* cos;  // [tokens, head_dim]
  const float* sin;
  int64_t cache_dtype;  // sluice::CacheDtype
  void* key_cache;      // [layers, slots, kv_heads, head_dim]
  void* value_cache;
  int64_t layer_stride;  // elements per layer of a cache
  const int64_t* slot_mapping;  // [tokens]
  const int64_t* block_tables;  // [requests, table_width]
  int64_t table_width, block_size;
  const int64_t* table_rows;    // [tokens]
  const int64_t* context_lens;  // [tokens]
  int64_t barrier_spin_ns;      // SpinBarrier::wait's
};

// Llama's RMSNorm of a row of n (HF's LlamaRMSNorm in float32): w * (x * 1 / sqrt(mean(x^2) + eps)).
void rms_norm(const float* x, int64_t n, const float* weight, float eps, float* out) {
  const float sum = sluice::torch_sum(
      n,
      [&](int64_t i) {
        const __m256 v = _mm256_loadu_ps(x + 8 * i);
        return _mm256_mul_ps(v, v);
      },
      [&](int64_t i) { return x[i] * x[i]; });
  const float inverse = 1.0f / sqrtf(sum / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * inverse);
}

// This thread's share [first, last) of `count` items.
struct Share {
  int64_t first, last;
};

Share share(int64_t count) {
  const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
  return {count * thread / threads, count * (thread + 1) / threads};
}

// This thread's panels of y[M, N] = x @ W.T (+ bias); returns its columns.
Share linear_share(const Linear& w, bool scalar, const float* x, int64_t rows, float* y) {
  const Share panels = share((w.out_features + 15) / 16);
  sluice::linear_columns(w.form, scalar, x, rows, w.in_features, w.panels, w.out_features, y, panels.first,
                         panels.last);
  const Share columns = {std::min(panels.first * 16, w.out_features), std::min(panels.last * 16, w.out_features)};
  if (w.bias != nullptr)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = columns.first; c < columns.last; ++c) y[r * w.out_features + c] += w.bias[c];
  return columns;
}

// n floats into the cache's elements, each rounded to nearest even as torch's Tensor.to rounds them.
void store(int64_t cache_dtype, const float* x, int64_t n, void* out) {
  if (cache_dtype == sluice::kCacheF32) {
    memcpy(out, x, n * sizeof(float));
  } else if (cache_dtype == sluice::kCacheBF16) {
    uint16_t* y = (uint16_t*)out;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      memcpy(&bits, x + i, 4);
      y[i] = x[i] != x[i] ? 0x7FC0 : (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
  } else {
    uint16_t* y = (uint16_t*)out;
    for (int64_t i = 0; i < n; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
  }
}

// x * cos + rotate_half(x) * sin for one head, as layers.Rotary.apply computes it.
void rotate(float* x, const float* cos, const float* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  float rotated[512];
  for (int64_t i = 0; i < head_dim; ++i) {
    const float other = i < half ? -x[i + half] : x[i - half];
    rotated[i] = x[i] * cos[i] + other * sin[i];
  }
  memcpy(x, rotated, head_dim * sizeof(float));
}

void layer_step(const Layer& layer, const Step& s, int64_t index, float* hidden, float* x, float* q, float* k,
                float* v, float* attended, float* gate, float* up, float* scores, sluice::SpinBarrier& barrier) {
  const int64_t t_dim = s.tokens, h_dim = s.hidden, hd = s.head_dim;
  const bool scalar = s.scalar != 0;
  // 1) Input norm (this thread's copy), q / k / v.
  for (int64_t t = 0; t < t_dim; ++t) rms_norm(hidden + t * h_dim, h_dim, layer.input_norm, layer.input_eps, x + t * h_dim);
  linear_share(layer.q, scalar, x, t_dim, q);
  linear_share(layer.k, scalar, x, t_dim, k);
  linear_share(layer.v, scalar, x, t_dim, v);
  barrier.wait(s.barrier_spin_ns);
  // 2) Per-head norms, rotary, and this step's keys and values into the cache.
  const int64_t element_bytes = s.cache_dtype == sluice::kCacheF32 ? 4 : 2;
  char* key_cache = (char*)s.key_cache + index * s.layer_stride * element_bytes;
  char* value_cache = (char*)s.value_cache + index * s.layer_stride * element_bytes;
  const int64_t slot_stride = s.kv_heads * hd;
  const Share tokens = share(t_dim);
  for (int64_t t = tokens.first; t < tokens.last; ++t) {
    const float* cos = s.cos + t * hd;
    const float* sin = s.sin + t * hd;
    float normed[512];
    for (int64_t h = 0; h < s.heads; ++h) {
      float* head = q + (t * s.heads + h) * hd;
      if (layer.q_norm != nullptr) {
        rms_norm(head, hd, layer.q_norm, layer.q_eps, normed);
        memcpy(head, normed, hd * sizeof(float));
      }
      rotate(head, cos, sin, hd);
    }
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      float* head = k + (t * s.kv_heads + h) * hd;
      if (layer.k_norm != nullptr) {
        rms_norm(head, hd, layer.k_norm, layer.k_eps, normed);
        memcpy(head, normed, hd * sizeof(float));
      }
      rotate(head, cos, sin, hd);
    }
    const int64_t slot = s.slot_mapping[t] * slot_stride * element_bytes;
    store(s.cache_dtype, k + t * slot_stride, slot_stride, key_cache + slot);
    store(s.cache_dtype, v + t * slot_stride, slot_stride, value_cache + slot);
  }
  barrier.wait(s.barrier_spin_ns);
  // 3) Attention, a (token, KV head) item at a time; its query heads share the passes over its keys and values.
  const int64_t group = s.heads / s.kv_heads;
  const int64_t chunk = sluice::slot_heads(t_dim, s.kv_heads, omp_get_num_threads());
#pragma omp for schedule(dynamic, chunk) nowait
  for (int64_t item = 0; item < t_dim * s.kv_heads; ++item) {
    const int64_t t = item / s.kv_heads, kv = item % s.kv_heads;
    const int64_t n = s.context_lens[t];
    const int64_t first = layer.window > 0 ? std::max<int64_t>(0, n - layer.window) : 0;
    const int64_t offset = (t * s.heads + kv * group) * hd;
    sluice::attend_heads(s.cache_dtype, group, q + offset, hd, key_cache + kv * hd * element_bytes,
                         value_cache + kv * hd * element_bytes, slot_stride,
                         s.block_tables + s.table_rows[t] * s.table_width, s.block_size, first, n, s.scale, 0.0f,
                         nullptr, sluice::slot_ahead(chunk, kv, slot_stride, hd), scores, attended + offset);
  }
  barrier.wait(s.barrier_spin_ns);
  // 4) o, added into the residual stream column by column (q is free again: it holds o).
  const Share o_columns = linear_share(layer.o, scalar, attended, t_dim, q);
  for (int64_t t = 0; t < t_dim; ++t)
    for (int64_t c = o_columns.first; c < o_columns.last; ++c) hidden[t * h_dim + c] += q[t * h_dim + c];
  barrier.wait(s.barrier_spin_ns);
  // 5) Post-attention norm (this thread's copy), gate and up, act(gate) * up on this thread's columns.
  for (int64_t t = 0; t < t_dim; ++t) rms_norm(hidden + t * h_dim, h_dim, layer.post_norm, layer.post_eps, x + t * h_dim);
  const Share columns = linear_share(layer.gate, scalar, x, t_dim, gate);
  linear_share(layer.up, scalar, x, t_dim, up);
  const int64_t i_dim = s.intermediate;
  for (int64_t t = 0; t < t_dim; ++t) {
    float* g = gate + t * i_dim;
    const float* u = up + t * i_dim;
    int64_t c = columns.first;
    for (; c + 8 <= columns.last; c += 8)
      _mm256_storeu_ps(g + c, _mm256_mul_ps(sluice::silu8(_mm256_loadu_ps(g + c)), _mm256_loadu_ps(u + c)));
    if (c < columns.last) {
      float lanes[8] = {}, products[8];
      std::copy(g + c, g + columns.last, lanes);
      _mm256_storeu_ps(lanes, sluice::silu8(_mm256_loadu_ps(lanes)));
      for (int64_t i = 0; i < columns.last - c; ++i) products[i] = lanes[i] * u[c + i];
      std::copy(products, products + (columns.last - c), g + c);
    }
  }
  barrier.wait(s.barrier_spin_ns);
  // 6) down, added into the residual stream (up is free again: it holds down's output).
  const Share d_columns = linear_share(layer.down, scalar, gate, t_dim, up);
  for (int64_t t = 0; t < t_dim; ++t)
    for (int64_t c = d_columns.first; c < d_columns.last; ++c) hidden[t * h_dim + c] += up[t * h_dim + c];
  barrier.wait(s.barrier_spin_ns);
}

}  // namespace

extern "C" {

// hidden[tokens, hidden] through layers [0, num_layers) of `layers`, in place.
void sl_decoder_layers(const Layer* layers, int64_t num_layers, const Step* step, float* hidden) {
  const Step& s = *step;
  const int64_t t_dim = s.tokens;
  int64_t longest = 0;
  for (int64_t t = 0; t < t_dim; ++t) longest = std::max(longest, s.context_lens[t]);
  const int64_t q_width = s.heads * s.head_dim, kv_width = s.kv_heads * s.head_dim;
  const int64_t widest = std::max(q_width, s.hidden);
  // Shared between the threads: q (later o), k, v, the attention's output, gate (later act(gate) * up), up
  // (later down's output).
  std::vector<float> shared(t_dim * (2 * widest + 2 * kv_width + 2 * s.intermediate));
  float* q = shared.data();
  float* k = q + t_dim * widest;
  float* v = k + t_dim * kv_width;
  float* attended = v + t_dim * kv_width;
  float* gate = attended + t_dim * widest;
  float* up = gate + t_dim * s.intermediate;
  sluice::SpinBarrier barrier;
#pragma omp parallel
  {
#pragma omp single
    barrier.threads = omp_get_num_threads();
    // The thread's own: a normalized input, attention scores.
    std::vector<float> x(t_dim * s.hidden), scores(sluice::kAttendScoreRows * (longest + 8));
    for (int64_t index = 0; index < num_layers; ++index)
      layer_step(layers[index], s, index, hidden, x.data(), q, k, v, attended, gate, up, scores.data(), barrier);
  }
}

}  // extern "C"
