"""The sampler's CPU kernel (sampling.cpp): one call draws a token for every row of a step.

It does what engine/sampling/sampler.py's torch path does (argmax for greedy rows; temperature,
top-k, top-p by rejection and min-p for the others, from the same counter-based uniforms), in
a few vector passes per row with no vocabulary-sized temporaries, rows spread over the
OpenMP threads. The two paths draw from the same distribution; their tokens for a seed agree
except where float rounding of the sums differs.
"""

from __future__ import annotations

import ctypes
import struct
from array import array
from collections.abc import Sequence

import torch

from engine.types import SamplingParams

# One row's settings as sl_sample reads them (struct RowSettings in sampling.cpp): 1 / temperature
# (0 for greedy), top_p, min_p and top_k.
_ROW = struct.Struct("=fffxxxxq")


def row_settings(p: SamplingParams) -> bytes:
    """A row's sampling parameters packed for the kernels (this one's and engine/kernels/gpu/sampling.py's)."""
    return _ROW.pack(0.0 if p.greedy else 1.0 / p.temperature, p.top_p, p.min_p, p.top_k)


def sample_on_cpu(
    library: ctypes.CDLL,
    logits: torch.Tensor,
    settings: bytes,
    keys: Sequence[int],
    positions: Sequence[int],
    block_max: torch.Tensor | None = None,
    maxima_rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """One token per row of float32 CPU `logits` [R, V], row i drawn with the i-th of `settings` (row_settings,
    joined), its draw key keys[i] at positions[i].

    `block_max`, where given: block maxima from the output head's kernel [rows, ceil(V / 256)], row i
    for row i of `logits` unless `maxima_rows` maps it elsewhere (-1: none applies, logits changed since)."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long)
    if block_max is not None:
        block_max = block_max.contiguous()
    keys = array("Q", keys)
    positions = array("q", positions)
    maxima_rows = array("q", maxima_rows) if maxima_rows is not None else None
    library.sl_sample(
        logits.data_ptr(),
        rows,
        vocab,
        logits.stride(0),
        settings,
        keys.buffer_info()[0],
        positions.buffer_info()[0],
        None if block_max is None else block_max.data_ptr(),
        None if maxima_rows is None else maxima_rows.buffer_info()[0],
        tokens.data_ptr(),
    )
    return tokens


def log_softmax_on_cpu(library: ctypes.CDLL, logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of float32 CPU `logits` [R, V] over each row (logprobs.cpp): torch's AVX2 bits on any CPU."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, vocab, dtype=torch.float32)
    library.sl_log_softmax(logits.data_ptr(), rows, vocab, logits.stride(0), out.data_ptr())
    return out
