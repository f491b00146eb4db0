"""The batch-invariant CPU kernel (engine/kernels/cpu/invariant.py) as an attention backend."""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from engine.kernels.cpu.invariant import KernelAttentionMetadata, invariant_paged_attention
from engine.model.attention.block_tables import block_tables
from engine.model.uploads import long_tensor

if TYPE_CHECKING:
    from engine.model.runner import Segment


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
