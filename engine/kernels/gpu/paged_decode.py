"""Paged decode attention on a GPU, in Triton: each decode token reads its own request's keys and
values straight through the block table, with no gather of every context into a padded copy.

One program per (decode token, KV head) computes every query head that shares the KV head, so each
key and value is loaded once for the group; it walks the context one cache block at a time with an
online softmax. A token's result depends on its own query and context alone, never on the batch
around it. Float32 inputs multiply in full precision (no TF32), so the kernel matches the SDPA path
it replaces; bfloat16 and float16 accumulate in float32.

Triton compiles for CUDA; with TRITON_INTERPRET=1 set before this module is imported it runs on
CPU tensors too, which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.online_softmax import attend_block


def supports(block_size: int, head_dim: int) -> bool:
    """Whether this kernel runs these shapes: a cache block of a power of two from 16 tokens (its
    tiles are one block), and a head of at most 256 dimensions."""
    return block_size >= 16 and block_size & (block_size - 1) == 0 and head_dim <= 256


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [D, H, hd] (one query per decode) over a layer's cache [slots, KVH, hd]; decode i reads
    keys 0 .. context_lens[i] - 1 of the request whose block table is block_tables[i]; with
    `window` > 0 only the last `window` of them. `softcap` > 0 caps the scores (softcap * tanh(s /
    softcap)); `sinks` [H] adds a logit per head to each softmax's denominator."""
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_decodes == 0:
        return out
    _paged_decode[(num_decodes, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        context_lens,
        q if sinks is None else sinks,
        scale,
        window,
        softcap,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        # tl.dot needs at least 16 rows: a small group is padded with masked heads.
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        IEEE=q.dtype == torch.float32,
        WINDOW=window > 0,
        SOFTCAP=softcap > 0,
        SINKS=sinks is not None,
    )
    return out


@triton.jit
def _paged_decode(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    lens_ptr,
    sinks_ptr,
    scale,
    window,
    softcap,
    q_token_stride,
    q_head_stride,
    k_slot_stride,
    k_head_stride,
    v_slot_stride,
    v_head_stride,
    out_token_stride,
    out_head_stride,
    table_stride,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    members = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + members
    dims = tl.arange(0, BLOCK_D)
    head_mask = (members < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + token * q_token_stride + heads[:, None] * q_head_stride + dims[None, :], mask=head_mask, other=0.0
    )
    context = tl.load(lens_ptr + token)
    offsets = tl.arange(0, BLOCK_SIZE)
    # The first key the token reads; the first page read holds it, so every row sees a key there.
    start = 0
    if WINDOW:
        start = tl.maximum(context - window, 0)
    if SINKS:
        best = tl.load(sinks_ptr + heads, mask=members < GROUP, other=0.0).to(tl.float32)
        total = tl.full([BLOCK_G], 1.0, tl.float32)
    else:
        best = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for page in range(start // BLOCK_SIZE, tl.cdiv(context, BLOCK_SIZE)):
        block = tl.load(tables_ptr + token * table_stride + page).to(tl.int64)
        slots = block * BLOCK_SIZE + offsets
        position = page * BLOCK_SIZE + offsets
        inside = (position < context) & (position >= start)
        kv_mask = inside[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(
            k_ptr + slots[:, None] * k_slot_stride + kv_head * k_head_stride + dims[None, :], mask=kv_mask, other=0.0
        )
        # Masked slots read as 0, not whatever memory holds: a weight of 0 times a NaN would still be NaN.
        v = tl.load(
            v_ptr + slots[:, None] * v_slot_stride + kv_head * v_head_stride + dims[None, :], mask=kv_mask, other=0.0
        )
        best, total, acc = attend_block(
            q, k, v, inside[None, :], best, total, acc, scale, softcap, IEEE, SOFTCAP, False
        )
    out = acc / total[:, None]
    tl.store(
        out_ptr + token * out_token_stride + heads[:, None] * out_head_stride + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_mask,
    )
