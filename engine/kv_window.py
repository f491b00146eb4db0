"""WindowedBlockManager: the block accounting of a model whose every layer slides a window, which hands back
the blocks a request's window has passed; DraftWindowedBlockManager: the same where a draft model, its every
layer sliding too, shares the block tables."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.kv_cache import BlockManager, point_released
from engine.request import Request


class WindowedBlockManager(BlockManager):
    """Where every layer reads at most `window` keys back (a query at p reads p - window + 1 .. p), a block
    wholly before what the next query reads is read by no future query of its request (positions only grow),
    so it returns to the pool at the step boundary. Its registration stays: a later request with the same
    prefix adopts it while it is in the pool, as it would a finished request's, and a prefix needs only the
    blocks that its next query reads to be found (each block's hash covers every token before it).

    A model with any global layer gets the plain BlockManager: nothing here runs per step for it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        window: int,
        enable_prefix_caching: bool = True,
        max_pinned_blocks: int = 0,
        max_idle_cached_blocks: int | None = None,
    ) -> None:
        if window < 1:
            raise ValueError("window must be positive")
        super().__init__(num_blocks, block_size, enable_prefix_caching, max_pinned_blocks, max_idle_cached_blocks)
        self.window = window

    def _first_read(self, num_tokens: int, window: int | None = None) -> int:
        """The first block that a query at position `num_tokens`, or any later one, reads (through `window`,
        the model's by default)."""
        return max(0, (num_tokens - (window or self.window) + 1) // self.block_size)

    def cached_prefix(self, request: Request) -> list[int]:
        """The longest prefix whose blocks from the first its next query reads are all cached, as the table
        the request starts on: the passed entries name the first of those blocks (they are never read)."""
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        found = [self._cached.get(prefix_hash) for prefix_hash in hashes]
        # run[i]: how many blocks up to block i are cached without a gap, so a prefix of n blocks is usable
        # when run[n - 1] reaches back to the first block its next query reads.
        run, length = [], 0
        for block_id in found:
            length = length + 1 if block_id is not None else 0
            run.append(length)
        for num_blocks in range(len(found), 0, -1):
            first = self._first_read(num_blocks * self.block_size)
            if run[num_blocks - 1] >= num_blocks - first:
                return [found[first]] * first + found[first:num_blocks]
        return []

    def num_blocks_to_admit(self, cached: list[int], num_new_tokens: int) -> int:
        """As BlockManager's, counting only the cached blocks the request holds (from the first one read)."""
        first = self._first_read(len(cached) * self.block_size)
        return self._num_fresh(len(cached), num_new_tokens) + self._num_in_pool(cached[first:])

    def adopt_prefix(self, request: Request, block_ids: list[int]) -> None:
        """`block_ids` as cached_prefix gives them: the entries before the first block read are not held."""
        super().adopt_prefix(request, block_ids, self._first_read(len(block_ids) * self.block_size))

    def register(self, request: Request) -> None:
        """Register the newly full blocks, then hand back those the window has passed, keeping one block more
        than the next query reads: a pin taken when the request ends then holds every block that a
        continuation's prefix lookup (which ends at a block boundary, up to a block before) needs. Called
        at every step boundary, after a speculative rollback, so `num_computed_tokens` counts only kept
        tokens. With a step in flight (overlapped steps on a GPU) it counts that step's tokens too: a block
        released now is written by another request only in a later step, after the step in flight has
        read it (stream order)."""
        super().register(request)
        released = self._num_passed(request)
        start = request.num_released_blocks
        if released <= start:
            return
        table = request.block_table
        for block_id in table[start:released]:
            self._release(block_id)
        point_released(table, released)
        request.num_released_blocks = released

    def _num_passed(self, request: Request) -> int:
        """How many of the request's first blocks no future query reads, but for the one register keeps."""
        return self._first_read(request.num_computed_tokens) - 1


class DraftWindowedBlockManager(WindowedBlockManager):
    """WindowedBlockManager's where a draft model shares the block tables and every one of its layers slides
    a window too (the widest `draft_window`). The draft computes behind the target: its next query is at the
    request's `num_draft_computed` (behind by the tokens of the target's last verification, or by whole steps
    where the draft did not propose), so a block returns to the pool only when neither model's next query
    reads it. The draft's position is cut to the request's tokens before the target verifies its proposals,
    so a rollback leaves it at a token the target kept: no block it reads next was handed back. A request
    starts with its draft at its first token (admitted, forked or recomputed), so the draft's first run
    writes and reads every block of it: a prefix is adopted whole, from block 0, as BlockManager finds it
    (blocks another request released stay cached while they are in the pool), and nothing is released
    before the draft has caught up.

    A draft with any global layer reads every block: the plain BlockManager then, as for the target."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        window: int,
        draft_window: int,
        enable_prefix_caching: bool = True,
        max_pinned_blocks: int = 0,
        max_idle_cached_blocks: int | None = None,
    ) -> None:
        if draft_window < 1:
            raise ValueError("draft_window must be positive")
        super().__init__(
            num_blocks, block_size, window, enable_prefix_caching, max_pinned_blocks, max_idle_cached_blocks
        )
        self.draft_window = draft_window

    def cached_prefix(self, request: Request) -> list[int]:
        """BlockManager's: the draft reads the prefix from its first block."""
        return BlockManager.cached_prefix(self, request)

    def num_blocks_to_admit(self, cached: list[int], num_new_tokens: int) -> int:
        """BlockManager's: every cached block is held."""
        return BlockManager.num_blocks_to_admit(self, cached, num_new_tokens)

    def adopt_prefix(self, request: Request, block_ids: list[int]) -> None:
        """BlockManager's: every entry held."""
        BlockManager.adopt_prefix(self, request, block_ids)

    def _num_passed(self, request: Request) -> int:
        """The target's passed blocks, no further than the draft's next query reads (a request that never
        speculates has no draft to wait for)."""
        passed = super()._num_passed(request)
        if not request.params.speculative:
            return passed
        return min(passed, self._first_read(request.num_draft_computed, self.draft_window))


def windowed_reach(windows: tuple[int, ...]) -> int:
    """How far back any layer reads (the widest window) where every layer slides one; 0 where any is global."""
    return max(windows) if windows and all(windows) else 0


def block_manager_for(
    config: EngineConfig, windows: tuple[int, ...], draft_windows: tuple[int, ...] | None = None
) -> BlockManager:
    """The windowed manager where every layer slides a window (and every layer of the draft model, given its
    `draft_windows`: it shares the block tables), the plain one otherwise."""
    shared = (
        config.enable_prefix_caching,
        int(config.num_kv_blocks * config.max_pinned_kv_fraction),
        config.max_idle_cached_blocks,
    )
    window = windowed_reach(windows)
    draft_window = windowed_reach(draft_windows) if draft_windows is not None else None
    if not window or draft_window == 0:
        return BlockManager(config.num_kv_blocks, config.block_size, *shared)
    if draft_window is None:
        return WindowedBlockManager(config.num_kv_blocks, config.block_size, window, *shared)
    return DraftWindowedBlockManager(config.num_kv_blocks, config.block_size, window, draft_window, *shared)
