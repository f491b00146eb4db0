"""Paged KV cache: block accounting (BlockManager) and the K/V storage it indexes (KVCache)."""

from __future__ import annotations

import math
import mmap
from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.request import Request


class BlockManager:
    """Hands out fixed-size KV blocks; `num_free + num_used == num_blocks` at all times.

    A block can be listed by several block tables (choices forked off one prompt, prompts
    that share a prefix); it returns to the pool when the last of them lets go.

    Prefix caching: a full block whose K/V are computed is registered under a hash of
    its tokens and of every token before them. A request that starts (or restarts after
    preemption) with the same tokens adopts those blocks instead of recomputing them.
    Registered blocks stay registered after their last user lets go: they sit in the free
    pool, in release order, and lose their registration only when handed out again, so
    the least recently released go first.

    Which free block a request gets: one that holds no cached prefix (least recently released
    first), else the least recently released cached one where more than `max_idle_cached_blocks`
    sit idle, else one never handed out (lowest id first), else the least recently released
    cached one. A CPU's pool is memory the kernel hands in page by page as it is first written:
    blocks never handed out cost nothing, so the pool's resident part grows with the blocks
    running requests hold at once plus the idle cache's bound, not with every block the pool has.

    Pins keep a finished request's registered blocks out of the pool (a stored conversation
    whose next turn should find its prefix): a pin holds one reference on each block until it
    expires, is removed, or is the oldest when pins would pass `max_pinned_blocks`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_pinned_blocks: int = 0,
        max_idle_cached_blocks: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # None: the idle cache keeps every block it can before a block never handed out is taken.
        self.max_idle_cached_blocks = num_blocks if max_idle_cached_blocks is None else max_idle_cached_blocks
        # Ordered sets of free blocks, released to the back and handed out from the front: those holding a
        # cached prefix (adopted from anywhere too) and the others; blocks from `_next_untouched` on were
        # never handed out.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._free_plain: OrderedDict[int, None] = OrderedDict()
        self._next_untouched = 0
        self._refs: dict[int, int] = {}
        self._cached: dict[int, int] = {}  # prefix hash -> block id
        self._hash_of: dict[int, int] = {}  # block id -> prefix hash
        # Prompt tokens looked up in the cache at admission, and how many were found.
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.max_pinned_blocks = max_pinned_blocks
        # key -> (blocks held, deadline), oldest pin first; and how many pins hold each block.
        self._pins: OrderedDict[str, tuple[list[int], float]] = OrderedDict()
        self._pinned: Counter[int] = Counter()

    @property
    def num_free(self) -> int:
        return len(self._free_cached) + len(self._free_plain) + self.num_untouched

    @property
    def num_untouched(self) -> int:
        """Blocks never handed out: on a CPU, pool memory not yet resident."""
        return self.num_blocks - self._next_untouched

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_pinned(self) -> int:
        """Distinct blocks held by pins."""
        return len(self._pinned)

    def pin(self, key: str, request: Request, deadline: float) -> bool:
        """Hold `request`'s registered blocks under `key` until `deadline` (a time.monotonic() value).
        Older pins are dropped first to stay within max_pinned_blocks; False if it cannot fit at all."""
        # Released blocks are not the request's to pin; they stay cached in the pool until handed out again.
        blocks = request.block_table[request.num_released_blocks : request.num_registered_blocks]
        self.unpin(key)
        new = len(set(blocks) - self._pinned.keys())
        if not blocks or new > self.max_pinned_blocks:
            return False
        while self.num_pinned + new > self.max_pinned_blocks:
            self.unpin(next(iter(self._pins)))
            new = len(set(blocks) - self._pinned.keys())
        for block_id in blocks:
            self._refs[block_id] += 1
            self._pinned[block_id] += 1
        self._pins[key] = (list(blocks), deadline)
        return True

    def extend_pin(self, key: str, deadline: float) -> None:
        if (pin := self._pins.get(key)) is not None:
            self._pins[key] = (pin[0], max(pin[1], deadline))

    def unpin(self, key: str) -> bool:
        """Let go of a pin's blocks (they stay cached in the pool until handed out again)."""
        pin = self._pins.pop(key, None)
        if pin is None:
            return False
        for block_id in pin[0]:
            self._pinned[block_id] -= 1
            if not self._pinned[block_id]:
                del self._pinned[block_id]
            self._release(block_id)
        return True

    def expire_pins(self, now: float) -> int:
        """Drop every pin whose deadline has passed; returns how many."""
        expired = [key for key, (_, deadline) in self._pins.items() if deadline <= now]
        for key in expired:
            self.unpin(key)
        return len(expired)

    @property
    def num_cached(self) -> int:
        """Registered blocks, in use or not."""
        return len(self._cached)

    def cached_prefix(self, request: Request) -> list[int]:
        """The registered blocks that hold the longest prefix of `request`'s tokens. The last
        token is never taken from the cache: its logits are what the next step samples from."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for prefix_hash in self._hashes(request, (request.num_tokens - 1) // self.block_size):
            block_id = self._cached.get(prefix_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def num_blocks_to_admit(self, cached: list[int], num_new_tokens: int) -> int:
        """Free-pool blocks a request holding none takes to start on its `cached` prefix blocks and
        add `num_new_tokens`: fresh blocks past the cached ones, plus the cached ones in the pool."""
        return self._num_fresh(len(cached), num_new_tokens) + self._num_in_pool(cached)

    def _num_fresh(self, num_cached_blocks: int, num_new_tokens: int) -> int:
        """Blocks past `num_cached_blocks` cached ones that `num_new_tokens` more tokens fill."""
        return -(-(num_cached_blocks * self.block_size + num_new_tokens) // self.block_size) - num_cached_blocks

    def _num_in_pool(self, block_ids: list[int]) -> int:
        return sum(1 for block_id in block_ids if block_id in self._free_cached)

    def adopt_prefix(self, request: Request, block_ids: list[int], num_released: int = 0) -> None:
        """Start `request` (holding no blocks) on the cached blocks of its prefix; the first `num_released`
        entries name blocks it does not hold (engine/kv_window.py)."""
        for block_id in block_ids[num_released:]:
            if block_id in self._free_cached:
                del self._free_cached[block_id]
                self._refs[block_id] = 1
            else:
                self._refs[block_id] += 1
        request.block_table = array("q", block_ids)
        request.num_registered_blocks = len(block_ids)
        request.num_released_blocks = num_released
        request.num_computed_tokens = len(block_ids) * self.block_size
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed_tokens
            self.num_prefix_queries += request.num_tokens
            self.num_prefix_hits += request.num_computed_tokens

    def register(self, request: Request) -> None:
        """Register the request's blocks that have become full of computed tokens."""
        num_full = request.num_computed_tokens // self.block_size
        start = request.num_registered_blocks
        if not self.enable_prefix_caching or num_full <= start:
            return
        for block_id, prefix_hash in zip(request.block_table[start:num_full], self._hashes(request, num_full)[start:]):
            # A block another request computed with the same tokens stays the one found.
            if prefix_hash not in self._cached:
                self._cached[prefix_hash] = block_id
                self._hash_of[block_id] = prefix_hash
        request.num_registered_blocks = num_full

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Hashes of the first `num_blocks` full blocks of the request's tokens, each chained to
        the one before it, so equal hashes mean equal prefixes (the hashes of the images whose tokens a
        block holds are part of its key). Tokens only ever append, so the
        request keeps what was computed. Python's tuple hash is 64 bits: a collision between
        two different prefixes is astronomically unlikely at the cache sizes used here."""
        hashes, size = request.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            start = len(hashes) * size
            key = (hashes[-1] if hashes else None, *request.token_ids[start : start + size])
            if request.images:
                # An image's tokens are one placeholder id whatever the image: its content hash tells them apart.
                key += tuple(i.content_hash for i in request.images if i.start < start + size and i.end > start)
            hashes.append(hash(key))
        return hashes[:num_blocks]

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` lacks to hold its computed tokens plus `num_new_tokens` more."""
        num_slots = request.num_computed_tokens + num_new_tokens
        return max(0, -(-num_slots // self.block_size) - len(request.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow `request.block_table` to cover `num_new_tokens` more; ask can_allocate first."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed > self.num_free:
            raise RuntimeError(f"allocate() of {needed} blocks with {self.num_free} free")
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
        released = parent.num_released_blocks
        for block_id in shared[released:]:
            self._refs[block_id] += 1
        copies = [(source, self._take()) for source in partial]
        child.block_table = shared + array("q", (destination for _, destination in copies))
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        child.num_released_blocks = released
        if released:
            # The parent's released entries name its first held block, which may be the copied one.
            point_released(child.block_table, released)
        return copies

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Let go of the blocks past the first `num_tokens` tokens (rejected speculative positions)."""
        keep = -(-num_tokens // self.block_size)
        for block_id in request.block_table[keep:]:
            self._release(block_id)
        del request.block_table[keep:]

    def deallocate(self, request: Request) -> None:
        """Let go of every block of `request`; unshared ones return to the pool."""
        for block_id in request.block_table[request.num_released_blocks :]:
            self._release(block_id)
        del request.block_table[:]
        request.num_registered_blocks = request.num_released_blocks = 0

    def _release(self, block_id: int) -> None:
        self._refs[block_id] -= 1
        if not self._refs[block_id]:
            del self._refs[block_id]
            (self._free_cached if block_id in self._hash_of else self._free_plain)[block_id] = None

    def _take(self) -> int:
        if self._free_plain:
            block_id, _ = self._free_plain.popitem(last=False)
        elif self._free_cached and (len(self._free_cached) > self.max_idle_cached_blocks or not self.num_untouched):
            block_id, _ = self._free_cached.popitem(last=False)
            del self._cached[self._hash_of.pop(block_id)]
        else:
            block_id = self._next_untouched
            self._next_untouched += 1
        self._refs[block_id] = 1
        return block_id

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Raise if a block is lost or free twice, or if the block tables of `requests` (every
        live request) do not account for exactly the used blocks and their share counts."""
        free = {*self._free_cached, *self._free_plain, *range(self._next_untouched, self.num_blocks)}
        if self._free_cached.keys() - self._hash_of.keys() or self._free_plain.keys() & self._hash_of.keys():
            raise AssertionError("a free block is listed as cached and is not, or the other way")
        if any(self._cached[h] != b for b, h in self._hash_of.items()) or len(self._cached) != len(self._hash_of):
            raise AssertionError("the prefix cache's two maps disagree")
        if free & self._refs.keys():
            raise AssertionError("a block is both free and used")
        if len(free) + len(self._refs) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + used {len(self._refs)} != {self.num_blocks}")
        listed: Counter[int] = Counter()
        for request in requests:
            table, released = request.block_table, request.num_released_blocks
            if released and (len(table) <= released or any(b != table[released] for b in table[:released])):
                raise AssertionError(f"a released entry of {request.request_id} names no block it holds")
            listed.update(table[released:])
        listed.update(block_id for blocks, _ in self._pins.values() for block_id in blocks)
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
        if device.type == "cpu":
            return cls(key=_untouched_zeros(shape, dtype), value=_untouched_zeros(shape, dtype))
        return cls(
            key=torch.zeros(shape, dtype=dtype, device=device),
            value=torch.zeros(shape, dtype=dtype, device=device),
        )

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous mapping of their own: the kernel hands each page in, zeroed, when it is first
    touched, so a CPU server's resident memory grows with the KV it uses instead of the whole pool at start
    (torch.zeros writes every page). The tensor keeps the mapping alive."""
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def point_released(table: array, num_released: int) -> None:
    """Name the first held block in each of `table`'s `num_released` released entries. A released block may
    be handed to another request at once. The CPU and Triton kernels never load a key before a query's
    window (their loops start at its first block); torch's SDPA path gathers a context from position 0 and
    masks what lies outside, so through these entries it reads only a block the request holds, never one
    that another request is writing."""
    table[:num_released] = array("q", (table[num_released],)) * num_released


def flat_block_tables(tables: Iterable[Sequence[int]], width: int, pad: int = 0) -> array:
    """The tables row after row, each cut or padded with block `pad` to `width`: the buffer of a
    [len(tables), width] tensor."""
    flat = array("q")
    for table in tables:
        if len(table) > width:
            table = table[:width]
        flat.extend(table)
        if len(table) < width:
            flat.extend([pad] * (width - len(table)))
    return flat
