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

Each of the three has its own metadata type, built once per step by its `build` from the
step's segments and never changed after.

Where a model's image tokens attend to each other both ways (Gemma 3), a step that computes an image's
tokens gives each token the end of the keys it reads (`key_ends`, image_key_ends): one past its own
position for text, one past its image block's last token for an image's (the scheduler keeps each block
in one chunk, so those keys are written by the time the attention reads them). A sliding window still
starts from the token's own position.
"""

from __future__ import annotations

import ctypes
import importlib.util
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from engine.kernels.invariant import KernelAttentionMetadata, invariant_paged_attention
from engine.kv_cache import flat_block_tables
from engine.model.uploads import long_tensor

if TYPE_CHECKING:
    from engine.model.runner import Segment


@dataclass(frozen=True)
class PrefillChunk:
    """One request's multi-token slice of the batch."""

    # First token of the chunk in the batch.
    start: int
    # Tokens the chunk computes this step.
    num_tokens: int
    # Cache slots of the whole context (cached tokens, then this chunk), or None when
    # nothing was cached before the chunk and the chunk's own K/V are the context.
    context_slots: torch.Tensor | None
    # [num_tokens, context_len] causal mask shifted past the cached tokens (keys before each token's end where
    # key_ends is given); None for a causal chunk with nothing cached.
    mask: torch.Tensor | None
    # [num_tokens] one past the last key each token reads, where some read past themselves (image blocks).
    key_ends: torch.Tensor | None = None


@dataclass(frozen=True)
class PagedDecode:
    """The decodes' block tables and context lengths, for a kernel that reads the cache through them
    (engine/kernels/paged_decode.py on a GPU) instead of a padded gather of every context."""

    kernel: Callable[..., torch.Tensor]
    # [D, W] block table of each decode's request, padded with block 0.
    block_tables: torch.Tensor
    # [D] keys each decode attends to: its position + 1.
    context_lens: torch.Tensor
    block_size: int


@dataclass(frozen=True)
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
    # [T] one past the last key each token of the step reads, where image blocks read past themselves.
    key_ends: torch.Tensor | None = None


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


@dataclass(frozen=True)
class TorchMetadata:
    """torch's SDPA: the decodes in one batched call over their contexts gathered and padded, and a
    causal call per prefill chunk."""

    # [T] cache slot that receives each token's K/V.
    slot_mapping: torch.Tensor
    # Decodes are tokens [0, num_decode_tokens) of the batch.
    num_decode_tokens: int
    # A prompt chunk with nothing cached reads its own k and v, not the cache's.
    reads_cache_only: ClassVar[bool] = False
    # [D, L] slots each decode reads, padded to the longest context L; None without decodes.
    decode_slots: torch.Tensor | None
    # [D, 1, 1, L] True for slots inside each decode's context.
    decode_mask: torch.Tensor | None
    # [D, 1, 1, 1] keys each decode attends to, for a sliding window's mask; None without decodes.
    decode_lens: torch.Tensor | None
    prefills: tuple[PrefillChunk, ...]

    @classmethod
    def build(
        cls,
        segments: Sequence[Segment],
        slot_mapping: torch.Tensor,
        block_size: int,
        key_ends: torch.Tensor | None = None,
    ) -> TorchMetadata:
        """`key_ends` [T]: one past the last key each token reads, where a step's image blocks read past
        themselves (image_key_ends); None for causal attention throughout."""
        device = slot_mapping.device
        prefills = []
        offset = 0
        for segment in segments:
            num_new = len(segment.token_ids)
            if num_new > 1:
                ends = None if key_ends is None else key_ends[offset : offset + num_new]
                prefills.append(_prefill_chunk(segment, offset, block_size, device, ends))
            offset += num_new
        decodes = [segment for segment in segments if len(segment.token_ids) == 1]
        decode_slots = decode_mask = decode_lens = None
        if decodes:
            decode_slots, decode_mask, decode_lens = _decode_context(decodes, block_size, device)
        return cls(slot_mapping, len(decodes), decode_slots, decode_mask, decode_lens, tuple(prefills))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window or softcap or sinks is not None:
            return self._attend_variant(q, k, v, k_cache, v_cache, scale, window, softcap, sinks)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        out = torch.empty_like(q)
        num_decodes = self.num_decode_tokens
        if num_decodes:
            # Grouped-query attention without copying K/V: the query heads that share a
            # KV head sit on the "query length" axis of one SDPA call.
            group = num_heads // num_kv_heads
            qd = q[:num_decodes].view(num_decodes, num_kv_heads, group, head_dim)
            kd = k_cache[self.decode_slots].transpose(1, 2)
            vd = v_cache[self.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, scale=scale)
            out[:num_decodes] = od.reshape(num_decodes, num_heads, head_dim)
        for chunk in self.prefills:
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

    def _attend_variant(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """`attend` with a sliding window, soft-capped scores or sinks: the same calls, each with an
        explicit mask, on `masked_attention`."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        num_decodes = self.num_decode_tokens
        if num_decodes:
            qd = q[:num_decodes].view(num_decodes, num_kv_heads, group, head_dim)
            kd = k_cache[self.decode_slots].transpose(1, 2)
            vd = v_cache[self.decode_slots].transpose(1, 2)
            mask = self.decode_mask
            if window:
                keys = torch.arange(mask.shape[-1], device=q.device)
                mask = mask & (keys >= self.decode_lens - window)
            head_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1)
            od = masked_attention(qd, kd, vd, mask, scale, softcap, head_sinks)
            out[:num_decodes] = od.reshape(num_decodes, num_heads, head_dim)
        for chunk in self.prefills:
            end = chunk.start + chunk.num_tokens
            if chunk.context_slots is None:
                kc, vc = k[chunk.start : end], v[chunk.start : end]
            else:
                kc, vc = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
            context_len = kc.shape[0]
            keys = torch.arange(context_len, device=q.device)
            queries = torch.arange(context_len - chunk.num_tokens, context_len, device=q.device).unsqueeze(1)
            mask = keys <= queries if chunk.key_ends is None else keys < chunk.key_ends.unsqueeze(1)
            if window:
                mask = mask & (keys > queries - window)
            qc = q[chunk.start : end].transpose(0, 1)
            kc = kc.transpose(0, 1).repeat_interleave(group, 0)
            vc = vc.transpose(0, 1).repeat_interleave(group, 0)
            head_sinks = None if sinks is None else sinks.view(num_heads, 1, 1)
            out[chunk.start : end] = masked_attention(qc, kc, vc, mask, scale, softcap, head_sinks).transpose(0, 1)
        return out


@dataclass(frozen=True)
class TritonMetadata:
    """The GPU's Triton paged kernels: one call for the decodes and one for every prefill chunk, each
    reading the cache through block tables."""

    # [T] cache slot that receives each token's K/V.
    slot_mapping: torch.Tensor
    # Decodes are tokens [0, num_decode_tokens) of the batch.
    num_decode_tokens: int
    # Every query reads its keys and values through the block tables.
    reads_cache_only: ClassVar[bool] = True
    # None without decodes.
    decode: PagedDecode | None
    # None without prefill chunks.
    prefill: PagedPrefill | None

    @classmethod
    def build(
        cls,
        kernels: GpuAttention,
        segments: Sequence[Segment],
        slot_mapping: torch.Tensor,
        block_size: int,
        key_ends: torch.Tensor | None = None,
    ) -> TritonMetadata:
        """`key_ends` as in TorchMetadata.build: only prefill chunks read past themselves (a single-token
        segment's image block ends at that token), so the decode kernel never takes them."""
        device = slot_mapping.device
        chunk_segments: list[Segment] = []
        chunks, tiles = array("q"), array("q")
        offset = 0
        for segment in segments:
            num_new = len(segment.token_ids)
            if num_new > 1:
                chunks.extend((offset, num_new, segment.start))
                for first in range(0, num_new, kernels.queries_per_tile):
                    tiles.extend((len(chunk_segments), first))
                chunk_segments.append(segment)
            offset += num_new
        prefill = None
        if chunk_segments:
            prefill = PagedPrefill(
                kernel=kernels.prefill,
                block_tables=block_tables(chunk_segments, block_size, device),
                chunks=long_tensor(chunks, device).view(-1, 3),
                tiles=long_tensor(tiles, device).view(-1, 2),
                block_size=block_size,
                key_ends=key_ends,
            )
        decodes = [segment for segment in segments if len(segment.token_ids) == 1]
        decode = None
        if decodes:
            decode = PagedDecode(
                kernel=kernels.decode,
                block_tables=block_tables(decodes, block_size, device),
                context_lens=long_tensor([segment.start + 1 for segment in decodes], device),
                block_size=block_size,
            )
        return cls(slot_mapping, len(decodes), decode, prefill)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.prefill is None:
            # Decodes alone (every step replayed from a CUDA graph): the decode kernel's output is the step's.
            return self._decode(q, k_cache, v_cache, scale, window, softcap, sinks)
        out = torch.empty_like(q)
        if self.decode is not None:
            num_decodes = self.num_decode_tokens
            out[:num_decodes] = self._decode(q[:num_decodes], k_cache, v_cache, scale, window, softcap, sinks)
        prefill = self.prefill
        prefill.kernel(
            q,
            k_cache,
            v_cache,
            out,
            prefill.block_tables,
            prefill.chunks,
            prefill.tiles,
            prefill.block_size,
            scale,
            window,
            softcap,
            sinks,
            prefill.key_ends,
        )
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        decode = self.decode
        return decode.kernel(
            q,
            k_cache,
            v_cache,
            decode.block_tables,
            decode.context_lens,
            decode.block_size,
            scale,
            window,
            softcap,
            sinks,
        )


@dataclass(frozen=True)
class InvariantMetadata:
    """The batch-invariant CPU kernel: every token reads its own request's keys 0 .. its position
    through the block table, decode or chunk alike, in one call."""

    # [T] cache slot that receives each token's K/V.
    slot_mapping: torch.Tensor
    kernel: KernelAttentionMetadata
    # Every query reads its keys and values through the block tables.
    reads_cache_only: ClassVar[bool] = True

    @classmethod
    def build(
        cls,
        library: ctypes.CDLL,
        segments: Sequence[Segment],
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        segment_rows: array,
        block_size: int,
        key_ends: torch.Tensor | None = None,
    ) -> InvariantMetadata:
        """`segment_rows`: each token's segment, its row of the block tables; `key_ends` as in
        TorchMetadata.build."""
        device = slot_mapping.device
        kernel = KernelAttentionMetadata(
            library=library,
            block_tables=block_tables(segments, block_size, device),
            table_rows=long_tensor(segment_rows, device),
            context_lens=positions + 1,
            block_size=block_size,
            key_ends=key_ends,
        )
        return cls(slot_mapping, kernel)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return invariant_paged_attention(q, k_cache, v_cache, self.kernel, scale, window, softcap, sinks)


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
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    return meta.attend(q, k, v, k_cache, v_cache, scale, window, softcap, sinks)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention of q [..., M, hd] over k, v [..., N, hd] where `mask` [..., M, N] is True, as
    transformers computes the variants: SDPA for a window alone, else scores soft-capped, masked, the
    sinks (broadcast to [..., M, 1]) appended as one more logit per row, softmax, and their column dropped."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, sink_column), dim=-1)
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if sinks is not None:
        weights = weights[..., :-1]
    return weights @ v


def block_tables(segments: Sequence[Segment], block_size: int, device: torch.device) -> torch.Tensor:
    """[S, W] block table of each segment's request, as far as its last token needs, padded with block 0."""
    width = max(-(-(segment.start + len(segment.token_ids)) // block_size) for segment in segments)
    return table_tensor([segment.request.block_table for segment in segments], width, device)


def table_tensor(tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """[len(tables), width]: each table cut or padded with block 0 to `width`."""
    return long_tensor(flat_block_tables(tables, width), device).view(len(tables), width)


def _prefill_chunk(
    segment: Segment, batch_start: int, block_size: int, device: torch.device, key_ends: torch.Tensor | None
) -> PrefillChunk:
    start, num_new = segment.start, len(segment.token_ids)
    end = start + num_new
    keys = torch.arange(end, device=device).unsqueeze(0)
    if key_ends is not None:
        mask = keys < key_ends.unsqueeze(1)
    elif start == 0:
        return PrefillChunk(batch_start, num_new, context_slots=None, mask=None)
    else:
        mask = keys <= torch.arange(start, end, device=device).unsqueeze(1)
    if start == 0:
        # Nothing cached before the chunk: its own k and v are the context.
        return PrefillChunk(batch_start, num_new, context_slots=None, mask=mask, key_ends=key_ends)
    table = segment.request.block_table
    context = long_tensor([table[p // block_size] * block_size + p % block_size for p in range(end)], device)
    return PrefillChunk(batch_start, num_new, context_slots=context, mask=mask, key_ends=key_ends)


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


def _decode_context(
    decodes: Sequence[Segment], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots of every decode's context, padded to the longest, the mask of real ones and the contexts'
    lengths [D, 1, 1, 1]."""
    context_lens = [segment.start + 1 for segment in decodes]
    max_len = max(context_lens)
    max_blocks = -(-max_len // block_size)
    tables = table_tensor([segment.request.block_table for segment in decodes], max_blocks, device)
    offsets = torch.arange(block_size, device=device)
    slots = (tables.unsqueeze(-1) * block_size + offsets).view(len(decodes), -1)[:, :max_len]
    lens = long_tensor(context_lens, device).view(len(decodes), 1, 1, 1)
    mask = torch.arange(max_len, device=device) < lens
    return slots, mask, lens
