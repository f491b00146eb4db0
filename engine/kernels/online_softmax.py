"""One block of keys and values into a running softmax-weighted sum, for the Triton paged attention
kernels (paged_decode.py, paged_prefill.py): each row keeps its best score so far, the sum of its
weights and the weighted sum of values, rescaled whenever a later block holds a better score."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(q, k, v, visible, best, total, acc, scale, IEEE: tl.constexpr):
    """q [M, D] against one block's k, v [N, D]; `visible` [M or 1, N] the keys each row may see.
    Returns the updated (best, total, acc). Float32 multiplies in full precision (no TF32) where IEEE;
    other dtypes accumulate in float32. A row that sees none of the block's keys keeps its values
    exactly (its weights are 0 and its rescale exp(0) = 1)."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(visible, scores * scale, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))
    rescale = tl.exp(best - new_best)
    p = tl.exp(scores - new_best[:, None])
    total = total * rescale + tl.sum(p, 1)
    if IEEE:
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
    return new_best, total, acc
