"""The sampler's CPU kernel (sampling.cpp): one call draws a token for every row of a step.

It does what engine/sampling/sampler.py's torch path does (argmax for greedy rows; temperature,
top-k, top-p by rejection and min-p for the others, from the same counter-based uniforms), in
a few vector passes per row with no vocabulary-sized temporaries, rows spread over the
OpenMP threads. The two paths draw from the same distribution; their tokens for a seed agree
except where float rounding of the sums differs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from engine.request import Request


def sample_on_cpu(
    library: ctypes.CDLL,
    logits: torch.Tensor,
    requests: Sequence[Request],
    positions: Sequence[int],
    block_max: torch.Tensor | None = None,
    maxima_rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """One token per row of float32 CPU `logits` [R, V], drawn for requests[i] at positions[i].

    `block_max`, where given: block maxima from the output head's kernel [rows, ceil(V / 256)], row i
    for row i of `logits` unless `maxima_rows` maps it elsewhere (-1: none applies, logits changed since)."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    params = [r.params for r in requests]
    tokens = torch.empty(rows, dtype=torch.long)
    if block_max is not None:
        block_max = block_max.contiguous()
    library.sl_sample(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0),
        (ctypes.c_float * rows)(*(0.0 if p.greedy else 1.0 / p.temperature for p in params)),
        (ctypes.c_int64 * rows)(*(p.top_k for p in params)),
        (ctypes.c_float * rows)(*(p.top_p for p in params)),
        (ctypes.c_float * rows)(*(p.min_p for p in params)),
        (ctypes.c_uint64 * rows)(*(r.rng_key for r in requests)),
        (ctypes.c_int64 * rows)(*positions),
        None if block_max is None else block_max.data_ptr(),
        None if maxima_rows is None else (ctypes.c_int64 * rows)(*maxima_rows),
        tokens.data_ptr(),
    )
    return tokens
