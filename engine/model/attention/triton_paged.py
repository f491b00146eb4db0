"""The GPU's Triton paged kernels (engine/kernels/gpu/paged_decode.py, paged_prefill.py): one call for a step's
decodes and one for all its prefill chunks, each reading the cache through block tables."""

from __future__ import annotations

import importlib.util
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.model.attention.block_tables import block_tables
from engine.model.uploads import long_tensor

if TYPE_CHECKING:
    from engine.model.runner import Segment


@dataclass(frozen=True)
class PagedDecode:
    """The decodes' block tables and context lengths, for a kernel that reads the cache through them
    (engine/kernels/gpu/paged_decode.py on a GPU) instead of a padded gather of every context."""

    kernel: Callable[..., torch.Tensor]
    # [D, W] block table of each decode's request, padded with block 0.
    block_tables: torch.Tensor
    # [D] keys each decode attends to: its position + 1.
    context_lens: torch.Tensor
    block_size: int


@dataclass(frozen=True)
class PagedPrefill:
    """Every prefill chunk of the step for one kernel call that reads the cache through the chunks'
    block tables (engine/kernels/gpu/paged_prefill.py on a GPU) instead of a gather and a call per chunk."""

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
    from engine.kernels.gpu import paged_decode, paged_prefill

    if not paged_decode.supports(block_size, head_dim):
        return None
    return GpuAttention(
        decode=paged_decode.paged_decode_attention,
        prefill=paged_prefill.paged_prefill_attention,
        queries_per_tile=paged_prefill.queries_per_tile(num_heads // num_kv_heads),
    )


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
