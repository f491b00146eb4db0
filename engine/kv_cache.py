"""Paged KV cache: block accounting (BlockManager) and the K/V storage it indexes (KVCache)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.request import Request


class BlockManager:
    """Hands out fixed-size KV blocks; `num_free + num_used == num_blocks` at all times.

    A block can be listed by several block tables (choices forked off one prompt); it
    returns to the pool when the last of them lets go.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

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
            request.block_table.append(self._take())

    def fork(self, parent: Request, child: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give `child` the blocks of the parent's first `num_tokens` tokens: full blocks shared,
        a partly filled last block copied, since both will write into it. Returns the
        (source, destination) blocks whose contents the caller must copy, or None when no
        block is free for the copy."""
        num_full = num_tokens // self.block_size
        shared = parent.block_table[:num_full]
        partial = parent.block_table[num_full : -(-num_tokens // self.block_size)]
        if not self.can_allocate(len(partial)):
            return None
        for block_id in shared:
            self._refs[block_id] += 1
        copies = [(source, self._take()) for source in partial]
        child.block_table = shared + [destination for _, destination in copies]
        return copies

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Let go of the blocks past the first `num_tokens` tokens (rejected speculative positions)."""
        keep = -(-num_tokens // self.block_size)
        for block_id in request.block_table[keep:]:
            self._release(block_id)
        del request.block_table[keep:]

    def deallocate(self, request: Request) -> None:
        """Let go of every block of `request`; unshared ones return to the pool."""
        for block_id in request.block_table:
            self._release(block_id)
        request.block_table.clear()

    def _release(self, block_id: int) -> None:
        self._refs[block_id] -= 1
        if not self._refs[block_id]:
            del self._refs[block_id]
            self._free.append(block_id)

    def _take(self) -> int:
        block_id = self._free.popleft()
        self._refs[block_id] = 1
        return block_id

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Raise if a block is lost or free twice, or if the block tables of `requests` (every
        live request) do not account for exactly the used blocks and their share counts."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is free twice")
        if free & self._refs.keys():
            raise AssertionError("a block is both free and used")
        if len(free) + len(self._refs) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {len(self._refs)} != {self.num_blocks}")
        listed = Counter(block_id for request in requests for block_id in request.block_table)
        if listed != Counter(self._refs):
            raise AssertionError(f"block tables list {dict(listed)}, but the pool counts {self._refs}")


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
