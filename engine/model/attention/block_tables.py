"""The block tables the paged backends read a request's cache through, as tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.kv_cache import flat_block_tables
from engine.model.uploads import long_tensor

if TYPE_CHECKING:
    from engine.model.runner import Segment


def block_tables(segments: Sequence[Segment], block_size: int, device: torch.device) -> torch.Tensor:
    """[S, W] block table of each segment's request, as far as its last token needs, padded with block 0."""
    width = max(-(-(segment.start + len(segment.token_ids)) // block_size) for segment in segments)
    return table_tensor([segment.request.block_table for segment in segments], width, device)


def table_tensor(tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """[len(tables), width]: each table cut or padded with block 0 to `width`."""
    return long_tensor(flat_block_tables(tables, width), device).view(len(tables), width)
