"""Rotary embedding and the KV cache's write in one Triton launch a layer, on a GPU.

Unfused, a layer rotated q and k with six of torch's ops each (two products, a negation, two
concatenations, a sum) and wrote k and v into the cache with two more launches: at one decode row
each launch is almost all overhead. This kernel reads a token's q, k and v once (views of the fused
q/k/v projection, any row stride), writes k rotated and v into the token's cache slot and returns q
rotated. It rounds where torch's ops round (each product to the activations' dtype, then their sum),
so its bits are the unfused path's; float multiply-adds are not contracted into FMAs, which would
round once where torch rounds twice.

Triton compiles for CUDA; with TRITON_INTERPRET=1 set before this module is imported it runs on
CPU tensors too, which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rotary_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, hd], k/v [T, KVH, hd] (each token's heads contiguous, rows of any stride); cos/sin
    [T, 1, rd] with rd <= hd (a partial rotary leaves features rd.. as they are). Writes rotated k and v
    into the caches [slots, KVH, hd] at slot_mapping [T]; returns rotated q [T, H, hd], contiguous."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos.shape[-1]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    for tensor in (q, k, v):
        assert tensor.stride(2) == 1 and tensor.stride(1) == head_dim, "a token's heads must be contiguous"
    for cache in (k_cache, v_cache):
        assert cache.stride(2) == 1 and cache.stride(1) == head_dim, "a slot's heads must be contiguous"
    _rotary_and_store[(num_tokens,)](
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        out,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        v_cache.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        ROTARY_DIM=rotary_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        enable_fp_fusion=False,
    )
    return out


@triton.jit
def _rotate(base, head_stride, heads, features, cos, sin, rotated, partner, sign, mask):
    """A token's heads [BLOCK heads, BLOCK_D] at `base`, rotated where `rotated` (as torch computes
    x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype), else as they are."""
    offsets = heads[:, None] * head_stride
    x = tl.load(base + offsets + features[None, :], mask=mask, other=0.0)
    other = tl.load(base + offsets + partner[None, :], mask=mask & rotated[None, :], other=0.0)
    first = (x.to(tl.float32) * cos[None, :]).to(x.dtype)
    second = ((other.to(tl.float32) * sign[None, :]) * sin[None, :]).to(x.dtype)
    return tl.where(rotated[None, :], (first.to(tl.float32) + second.to(tl.float32)).to(x.dtype), x)


@triton.jit
def _rotary_and_store(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    out_ptr,
    q_row_stride,
    k_row_stride,
    v_row_stride,
    cos_row_stride,
    sin_row_stride,
    k_cache_slot_stride,
    v_cache_slot_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    features = tl.arange(0, BLOCK_D)
    inside = features < HEAD_DIM
    rotated = features < ROTARY_DIM
    half = ROTARY_DIM // 2
    # rotate_half: feature d < half takes -x[d + half], feature d >= half takes x[d - half].
    partner = tl.where(features < half, features + half, features - half)
    sign = tl.where(features < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + token * cos_row_stride + features, mask=rotated, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_row_stride + features, mask=rotated, other=0.0).to(tl.float32)

    heads = tl.arange(0, BLOCK_H)
    q_mask = (heads < NUM_HEADS)[:, None] & inside[None, :]
    q = _rotate(q_ptr + token * q_row_stride, HEAD_DIM, heads, features, cos, sin, rotated, partner, sign, q_mask)
    tl.store(out_ptr + token * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + features[None, :], q, mask=q_mask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    kv_heads = tl.arange(0, BLOCK_KV)
    kv_mask = (kv_heads < NUM_KV_HEADS)[:, None] & inside[None, :]
    k = _rotate(k_ptr + token * k_row_stride, HEAD_DIM, kv_heads, features, cos, sin, rotated, partner, sign, kv_mask)
    cache_offsets = kv_heads[:, None] * HEAD_DIM + features[None, :]
    tl.store(k_cache_ptr + slot * k_cache_slot_stride + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v = tl.load(v_ptr + token * v_row_stride + cache_offsets, mask=kv_mask, other=0.0)
    tl.store(v_cache_ptr + slot * v_cache_slot_stride + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)
