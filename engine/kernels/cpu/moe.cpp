// A mixture-of-experts layer's routing and the weighted sum of its experts' outputs, one token at a time:
// a token's experts, weights and output depend on its own router logits and expert outputs alone, in a
// fixed order (k = 0, 1, ..., top_k - 1), whatever else is in the step. Built into one library with
// invariant.cpp (engine/kernels/cpu/native.py); the experts' matrices run on its sl_grouped_linear.

#include <math.h>
#include <stdint.h>

#include <vector>

extern "C" {

// How a token's routing weights are computed (engine/model/moe.py's Routing).
enum Routing : int64_t {
  // softmax over every expert's logit, the top_k probabilities as they are (Qwen3-MoE by default)
  SOFTMAX = 0,
  // the same, divided by their sum (Mixtral)
  SOFTMAX_RENORMALIZED = 1,
  // a softmax over the top_k logits alone (gpt-oss): the same numbers as SOFTMAX_RENORMALIZED, rounded otherwise
  TOP_K_SOFTMAX = 2,
};

// Per token t: its top_k experts by router logit [T, E] (the lower index first on a tie) and their weights
// as `routing` says: experts[t * top_k + j] and weights[t * top_k + j], j in decreasing logit. Then the
// step's token slots (t, j) grouped by expert: counts[e] slots route to expert e; grouped row r holds token
// source_rows[r], slots of expert 0 first, each expert's in token order; slot t * top_k + j sits at grouped
// row positions[t * top_k + j].
void sl_moe_route(const float* logits, int64_t num_tokens, int64_t num_experts, int64_t top_k, int64_t routing,
                  float* weights, int64_t* experts, int64_t* counts, int64_t* source_rows, int64_t* positions) {
  std::vector<float> probs(num_experts);
  std::vector<char> taken(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) counts[e] = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * num_experts;
    if (routing == TOP_K_SOFTMAX) {
      for (int64_t e = 0; e < num_experts; ++e) taken[e] = 0;
      for (int64_t j = 0; j < top_k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < num_experts; ++e)
          if (!taken[e] && (best < 0 || row[e] > row[best])) best = e;
        taken[best] = 1;
        experts[t * top_k + j] = best;
        ++counts[best];
      }
      // The first is the largest logit: softmax over the k, summed in j order.
      const float largest = row[experts[t * top_k]];
      float total = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) {
        weights[t * top_k + j] = expf(row[experts[t * top_k + j]] - largest);
        total += weights[t * top_k + j];
      }
      for (int64_t j = 0; j < top_k; ++j) weights[t * top_k + j] /= total;
      continue;
    }
    float largest = row[0];
    for (int64_t e = 1; e < num_experts; ++e) largest = row[e] > largest ? row[e] : largest;
    float total = 0.0f;
    for (int64_t e = 0; e < num_experts; ++e) {
      probs[e] = expf(row[e] - largest);
      total += probs[e];
    }
    for (int64_t e = 0; e < num_experts; ++e) probs[e] /= total;
    float chosen = 0.0f;
    for (int64_t e = 0; e < num_experts; ++e) taken[e] = 0;
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e)
        if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
      taken[best] = 1;
      experts[t * top_k + j] = best;
      weights[t * top_k + j] = probs[best];
      chosen += probs[best];
      ++counts[best];
    }
    if (routing == SOFTMAX_RENORMALIZED)
      for (int64_t j = 0; j < top_k; ++j) weights[t * top_k + j] /= chosen;
  }
  // Counting sort of the slots by expert, stable in token order.
  std::vector<int64_t> next(num_experts);
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    next[e] = start;
    start += counts[e];
  }
  for (int64_t slot = 0; slot < num_tokens * top_k; ++slot) {
    const int64_t r = next[experts[slot]]++;
    source_rows[r] = slot / top_k;
    positions[slot] = r;
  }
}

// out[t] = sum over j of weights[t * top_k + j] * y[positions[t * top_k + j]], y [T * top_k, H] grouped as
// sl_moe_route says, each product rounded, then added in j order.
void sl_moe_combine(const float* y, const float* weights, const int64_t* positions, int64_t num_tokens,
                    int64_t top_k, int64_t hidden, float* out) {
#pragma omp parallel for
  for (int64_t t = 0; t < num_tokens; ++t) {
    float* o = out + t * hidden;
    for (int64_t j = 0; j < top_k; ++j) {
      const float w = weights[t * top_k + j];
      const float* src = y + positions[t * top_k + j] * hidden;
      if (j == 0)
        for (int64_t h = 0; h < hidden; ++h) o[h] = w * src[h];
      else
        for (int64_t h = 0; h < hidden; ++h) o[h] = o[h] + w * src[h];
    }
  }
}

}  // extern "C"
