"""One block of keys and values into a running softmax-weighted sum, for the Triton paged attention
kernels (paged_decode.py, paged_prefill.py): each row keeps its best score so far, the sum of its
weights and the weighted sum of values, rescaled whenever a later block holds a better score.
An attention sink (gpt-oss) is this state's start: best = the sink's logit, total = 1, acc = 0."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_block(
    q, k, v, visible, best, total, acc, scale, softcap, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, SPARSE: tl.constexpr
):
    """q [M, D] against one block's k, v [N, D]; `visible` [M or 1, N] the keys each row may see.
    Returns the updated (best, total, acc). Float32 multiplies in full precision (no TF32) where IEEE;
    other dtypes accumulate in float32. With SOFTCAP, scores become softcap * tanh(score / softcap).
    A row that sees none of the block's keys keeps its values exactly (its weights are 0 and its
    rescale exp(0) = 1) once it has seen a key; SPARSE (a sliding window, where a row may see nothing
    in a tile's first blocks) keeps a row that has seen none yet at its start instead of NaN."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * scale
    if SOFTCAP:
        # tanh(x) = 2 sigmoid(2x) - 1: tl has no tanh that also runs in the interpreter.
        scores = softcap * (2.0 * tl.sigmoid(2.0 * (scores / softcap)) - 1.0)
    scores = tl.where(visible, scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))
    shift = new_best
    if SPARSE:
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
    rescale = tl.exp(best - shift)
    p = tl.exp(scores - shift[:, None])
    total = total * rescale + tl.sum(p, 1)
    if IEEE:
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
    return new_best, total, acc
