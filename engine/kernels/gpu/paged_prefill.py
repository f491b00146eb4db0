"""Paged prefill attention on a GPU, in Triton: every prefill chunk of a step in one launch, each
query reading its request's keys and values straight through the block table. No chunk gathers its
context into a copy, and none gets a call or a mask of its own.

A program computes one tile of a chunk's queries for one KV head: BLOCK_Q consecutive query tokens
times the query heads that share the KV head, as the rows of one matrix, so each key and value is
loaded once for all of them. It walks the context one cache block at a time with an online softmax,
up to the tile's last query; a query masks the keys after its own position, so a key block past it
adds exact zeros to that query's sums. Float32 inputs multiply in full precision (no TF32), as in
paged_decode.py; bfloat16 and float16 accumulate in float32.

Triton compiles for CUDA; with TRITON_INTERPRET=1 set before this module is imported it runs on
CPU tensors too, which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.gpu.online_softmax import attend_block

# Rows of a program's query matrix: query tokens times the query heads of one KV head.
_TILE_ROWS = 64


def queries_per_tile(group: int) -> int:
    """Query tokens of a chunk one program takes, for `group` query heads per KV head."""
    return max(1, _TILE_ROWS // triton.next_power_of_2(group))


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    chunks: torch.Tensor,
    tiles: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    key_ends: torch.Tensor | None = None,
) -> None:
    """Writes out[t] for every query t of the prefill chunks; other rows of `out` are left alone.

    q, out [T, H, hd] are the whole step's tokens; the layer's cache [slots, KVH, hd] already holds
    this step's keys and values. Chunk c is chunks[c] = (first token in q, tokens, tokens of its
    request cached before it) and reads its request's blocks block_tables[c]. tiles[i] = (chunk,
    first query of the chunk) lists each program's queries_per_tile() tokens. `window`, `softcap` and
    `sinks` as in paged_decode_attention. `key_ends` [T] (else None: causal) lets query t read keys up to
    key_ends[t] (exclusive), past its own position: an image's tokens that see their whole image, which
    lies within the chunk; a window still starts from the query's position."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if tiles.shape[0] == 0:
        return
    block_g = triton.next_power_of_2(group)
    _paged_prefill[(tiles.shape[0], num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        chunks,
        tiles,
        q if sinks is None else sinks,
        chunks if key_ends is None else key_ends,
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
        BLOCK_G=block_g,
        BLOCK_Q=queries_per_tile(group),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        IEEE=q.dtype == torch.float32,
        WINDOW=window > 0,
        SOFTCAP=softcap > 0,
        SINKS=sinks is not None,
        KEY_ENDS=key_ends is not None,
    )


@triton.jit
def _paged_prefill(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    chunks_ptr,
    tiles_ptr,
    sinks_ptr,
    ends_ptr,
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
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    KEY_ENDS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.load(tiles_ptr + 2 * tile)
    first_query = tl.load(tiles_ptr + 2 * tile + 1)
    chunk_start = tl.load(chunks_ptr + 3 * chunk)
    chunk_len = tl.load(chunks_ptr + 3 * chunk + 1)
    num_cached = tl.load(chunks_ptr + 3 * chunk + 2)

    # Row r of the tile is query token first_query + r // BLOCK_G of the chunk, head r % BLOCK_G of
    # the group.
    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    query = first_query + rows // BLOCK_G
    member = rows % BLOCK_G
    dims = tl.arange(0, BLOCK_D)
    row_mask = (query < chunk_len) & (member < GROUP)
    qd_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    token = (chunk_start + query).to(tl.int64)
    head = kv_head * GROUP + member
    q = tl.load(
        q_ptr + token[:, None] * q_token_stride + head[:, None] * q_head_stride + dims[None, :], mask=qd_mask, other=0.0
    )
    # Each query's position in its request; it attends to keys 0 .. position (to its key end, with KEY_ENDS).
    position = num_cached + query
    last = num_cached + tl.minimum(first_query + BLOCK_Q, chunk_len)
    key_end = position + 1
    if KEY_ENDS:
        key_end = tl.load(ends_ptr + token, mask=row_mask, other=0)
        # An image's tokens read past the tile's last query, to their image's end (within the chunk).
        last = tl.maximum(last, tl.max(key_end, 0))
        key_end = tl.where(row_mask, key_end, position + 1)
    offsets = tl.arange(0, BLOCK_SIZE)
    # The first key any query of the tile reads: the window's start for its first query.
    start = 0
    if WINDOW:
        start = tl.maximum(num_cached + first_query - window + 1, 0)
    if SINKS:
        best = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32)
        total = tl.full([BLOCK_Q * BLOCK_G], 1.0, tl.float32)
    else:
        best = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    for page in range(start // BLOCK_SIZE, tl.cdiv(last, BLOCK_SIZE)):
        block = tl.load(tables_ptr + chunk * table_stride + page).to(tl.int64)
        slots = block * BLOCK_SIZE + offsets
        key_position = page * BLOCK_SIZE + offsets
        kv_mask = (key_position < last)[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(
            k_ptr + slots[:, None] * k_slot_stride + kv_head * k_head_stride + dims[None, :], mask=kv_mask, other=0.0
        )
        # Masked slots read as 0, not whatever memory holds: a weight of 0 times a NaN would still be NaN.
        v = tl.load(
            v_ptr + slots[:, None] * v_slot_stride + kv_head * v_head_stride + dims[None, :], mask=kv_mask, other=0.0
        )
        # Without a window every row sees key 0 on the first page, so `best` is finite from then on;
        # with one, a later query's window may start pages later (SPARSE).
        visible = key_position[None, :] < key_end[:, None]
        if WINDOW:
            visible = visible & (key_position[None, :] > position[:, None] - window)
        best, total, acc = attend_block(q, k, v, visible, best, total, acc, scale, softcap, IEEE, SOFTCAP, WINDOW)
    result = acc / total[:, None]
    tl.store(
        out_ptr + token[:, None] * out_token_stride + head[:, None] * out_head_stride + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=qd_mask,
    )
