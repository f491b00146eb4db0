"""Attention over a ragged batch whose K/V live in paged cache slots.

Tokens of one step are laid out decodes first, then prefill chunks:

    | d0 d1 ... d(D-1) | chunk of request a ......... | chunk of request b .... |
      one query each,    queries num_cached .. num_cached + num_tokens - 1
      batched together   of a's sequence, attended causally

Linear layers run on all T tokens at once (no padding). With torch's kernels,
decodes share one batched attention call, padded only inside the K/V gather and
masked, and each prefill chunk gets its own call. On a GPU, two Triton kernels
read K/V through the block table instead: one for the decodes, one for all the
prefill chunks together. With the batch-invariant
kernels every query, decode or chunk, reads its own request's keys through the
block table in one call (engine/kernels/invariant.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels.invariant import KernelAttentionMetadata, invariant_paged_attention


@dataclass
class PrefillChunk:
    """One request's multi-token slice of the batch."""

    # First token of the chunk in the batch.
    start: int
    # Tokens the chunk computes this step.
    num_tokens: int
    # Cache slots of the whole context (cached tokens, then this chunk), or None when
    # nothing was cached before the chunk and the chunk's own K/V are the context.
    context_slots: torch.Tensor | None
    # [num_tokens, context_len] causal mask shifted past the cached tokens; None with context_slots.
    mask: torch.Tensor | None


@dataclass
class PagedDecode:
    """The decodes' block tables and context lengths, for a kernel that reads the cache through them
    (engine/kernels/paged_decode.py on a GPU) instead of a padded gather of every context."""

    kernel: Callable[..., torch.Tensor]
    # [D, W] block table of each decode's request, padded with block 0.
    block_tables: torch.Tensor
    # [D] keys each decode attends to: its position + 1.
    context_lens: torch.Tensor
    block_size: int


@dataclass
class PagedPrefill:
    """Every prefill chunk of the step for one kernel call that reads the cache through the chunks'
    block tables (engine/kernels/paged_prefill.py on a GPU) instead of a gather and a call per chunk."""

    kernel: Callable[..., None]
    # [C, W] block table of each chunk's request, padded with block 0.
    block_tables: torch.Tensor
    # [C, 3] each chunk's first token in the batch, its tokens, and its request's tokens cached before it.
    chunks: torch.Tensor
    # [N, 2] (chunk, first query of the chunk) of each of the kernel's tiles of queries.
    tiles: torch.Tensor
    block_size: int


@dataclass(frozen=True)
class GpuAttention:
    """The Triton paged attention kernels, and how many of a chunk's queries one prefill tile takes."""

    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., None]
    queries_per_tile: int


def gpu_attention(
    device: torch.device, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int
) -> GpuAttention | None:
    """The Triton paged kernels where they run: a CUDA device, Triton installed (it ships with CUDA
    PyTorch), and a cache block and head they take; None elsewhere (the SDPA path then runs)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from engine.kernels import paged_decode, paged_prefill

    if not paged_decode.supports(block_size, head_dim):
        return None
    return GpuAttention(
        decode=paged_decode.paged_decode_attention,
        prefill=paged_prefill.paged_prefill_attention,
        queries_per_tile=paged_prefill.queries_per_tile(num_heads // num_kv_heads),
    )


@dataclass
class AttentionMetadata:
    """Where each token's K/V is written and which cached K/V each query reads."""

    # [T] cache slot that receives each token's K/V.
    slot_mapping: torch.Tensor
    # Decodes are tokens [0, num_decode_tokens) of the batch.
    num_decode_tokens: int
    # [D, L] slots each decode reads, padded to the longest context L.
    decode_slots: torch.Tensor | None
    # [D, 1, 1, L] True for slots inside each decode's context.
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    # For the batch-invariant kernels instead of the fields above (they are then empty).
    kernel: KernelAttentionMetadata | None = None
    # For a paged decode kernel instead of decode_slots and decode_mask.
    paged_decode: PagedDecode | None = None
    # For a paged prefill kernel instead of prefills.
    paged_prefill: PagedPrefill | None = None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, hd], k/v [T, KVH, hd] → [T, H, hd]; writes this step's K/V into the cache first."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.kernel is not None:
        return invariant_paged_attention(q, k_cache, v_cache, meta.kernel, scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    out = torch.empty_like(q)

    num_decodes = meta.num_decode_tokens
    if num_decodes and meta.paged_decode is not None:
        decode = meta.paged_decode
        out[:num_decodes] = decode.kernel(
            q[:num_decodes], k_cache, v_cache, decode.block_tables, decode.context_lens, decode.block_size, scale
        )
    elif num_decodes:
        # Grouped-query attention without copying K/V: the query heads that share a
        # KV head sit on the "query length" axis of one SDPA call.
        group = num_heads // num_kv_heads
        qd = q[:num_decodes].view(num_decodes, num_kv_heads, group, head_dim)
        kd = k_cache[meta.decode_slots].transpose(1, 2)
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:num_decodes] = od.reshape(num_decodes, num_heads, head_dim)

    if meta.paged_prefill is not None:
        prefill = meta.paged_prefill
        prefill.kernel(
            q, k_cache, v_cache, out, prefill.block_tables, prefill.chunks, prefill.tiles, prefill.block_size, scale
        )
    for chunk in meta.prefills:
        end = chunk.start + chunk.num_tokens
        qc = q[chunk.start : end].transpose(0, 1)
        if chunk.context_slots is None:
            kc, vc = k[chunk.start : end], v[chunk.start : end]
        else:
            kc, vc = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
        oc = F.scaled_dot_product_attention(
            qc,
            kc.transpose(0, 1),
            vc.transpose(0, 1),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[chunk.start : end] = oc.transpose(0, 1)
    return out
