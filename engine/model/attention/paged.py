"""paged_attention, what every layer calls: the step's K/V into the cache, then its backend's attention."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.model.attention.invariant import InvariantMetadata
from engine.model.attention.torch_sdpa import TorchMetadata
from engine.model.attention.triton_paged import TritonMetadata

if TYPE_CHECKING:
    from engine.model.runner import Segment


AttentionMetadata = TorchMetadata | TritonMetadata | InvariantMetadata


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, hd], k/v [T, KVH, hd] → [T, H, hd]; writes this step's K/V into the cache first.

    The variants, each off by default: `window` > 0, a query at position p reads keys (p - window, p]
    only (a sliding window); `softcap` > 0, scores become softcap * tanh(score / softcap); `sinks`
    [H] float32, a learned logit per head that joins each softmax's max and denominator but adds no
    value (gpt-oss)."""
    if k.dtype != k_cache.dtype:
        # A narrower cache (--kv-cache-dtype): each key and value rounded once, to nearest even, as stored.
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    return meta.attend(q, k, v, k_cache, v_cache, scale, window, softcap, sinks)


def image_key_ends(segments: Sequence[Segment], positions: array) -> array | None:
    """One past the last key each token of the step reads (`positions`: each token's, in segment order):
    its position + 1, or for a token of one of its request's image blocks (Request.image_blocks) the
    block's end. None when no token of the step is in an image block (causal attention throughout)."""
    ends: array | None = None
    offset = 0
    for segment in segments:
        start, count = segment.start, len(segment.token_ids)
        for block_start, block_end in segment.request.image_blocks:
            low, high = max(block_start, start), min(block_end, start + count)
            if low < high:
                if ends is None:
                    ends = array("q", (p + 1 for p in positions))
                ends[offset + low - start : offset + high - start] = array("q", [block_end] * (high - low))
        offset += count
    return ends
