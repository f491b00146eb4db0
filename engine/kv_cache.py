"""Paged KV cache: block accounting (BlockManager) and the K/V storage it indexes (KVCache)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.request import Request


class BlockManager:
    """Hands out fixed-size KV blocks; `num_free + num_used == num_blocks` at all times."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, Request] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` lacks to hold its computed tokens plus `num_new_tokens` more."""
        num_slots = request.num_computed_tokens + num_new_tokens
        return max(0, -(-num_slots // self.block_size) - len(request.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow `request.block_table` to cover `num_new_tokens` more; ask can_allocate first."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"allocate() of {needed} blocks with {len(self._free)} free")
        for _ in range(needed):
            block_id = self._free.popleft()
            self._owner[block_id] = request
            request.block_table.append(block_id)

    def deallocate(self, request: Request) -> None:
        """Return every block of `request` to the pool."""
        for block_id in request.block_table:
            del self._owner[block_id]
            self._free.append(block_id)
        request.block_table.clear()

    def check_integrity(self) -> None:
        """Raise if a block is lost, doubly owned or owned by a table that does not list it."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is free twice")
        if free & self._owner.keys():
            raise AssertionError("a block is both free and used")
        if len(free) + len(self._owner) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {len(self._owner)} != {self.num_blocks}")
        for block_id, request in self._owner.items():
            if block_id not in request.block_table:
                raise AssertionError(f"block {block_id} is owned but not in its block table")


@dataclass
class KVCache:
    """K and V for every layer, stored as flat slots: slot = block_id * block_size + offset."""

    key: torch.Tensor  # [num_layers, num_slots, num_kv_heads, head_dim]
    value: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        return cls(
            key=torch.zeros(shape, dtype=dtype, device=device),
            value=torch.zeros(shape, dtype=dtype, device=device),
        )

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
