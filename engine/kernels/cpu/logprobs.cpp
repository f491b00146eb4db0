// Log-softmax of a step's logits rows for their logprobs, with torch's AVX2 bits on any CPU
// (torch_math.h): torch's own log_softmax sums in another order under AVX-512, so the same
// logits gave other logprobs there.

#include <math.h>
#include <stdint.h>

#include "torch_math.h"

extern "C" {

// out[R, V] = log_softmax(logits[R, V]) over each row, logits' rows `stride` floats apart.
void sl_log_softmax(const float* logits, int64_t rows, int64_t vocab, int64_t stride, float* out) {
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * stride;
    float max = -INFINITY;
    for (int64_t i = 0; i < vocab; ++i) max = x[i] > max ? x[i] : max;
    const float log_sum = sluice::sleef_log(sluice::exp_sum(x, vocab, max));
    float* y = out + r * vocab;
    for (int64_t i = 0; i < vocab; ++i) y[i] = (x[i] - max) - log_sum;
  }
}

}  // extern "C"
