"""WindowedBlockManager: the block accounting of a model whose every layer slides a window, which hands back
the blocks a request's window has passed."""

from __future__ import annotations

from engine.kv_cache import BlockManager, point_released
from engine.request import Request


class WindowedBlockManager(BlockManager):
    """Where every layer reads at most `window` keys back (a query at p reads (p - window, p]), a block
    wholly before `num_computed_tokens - window` is read by no future query of its request (positions only
    grow), so it returns to the pool at the step boundary. Its registration stays: a later request with the
    same prefix adopts it while it is in the pool, as it would a finished request's.

    A model with any global layer gets the plain BlockManager: nothing here runs per step for it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        window: int,
        enable_prefix_caching: bool = True,
        max_pinned_blocks: int = 0,
    ) -> None:
        if window < 1:
            raise ValueError("window must be positive")
        super().__init__(num_blocks, block_size, enable_prefix_caching, max_pinned_blocks)
        self.window = window

    def num_blocks_to_admit(self, cached: list[int], num_new_tokens: int) -> int:
        """As BlockManager's, less the cached blocks in the pool that the window has passed already:
        adopt_prefix hands them back at once."""
        passed = self._num_passed(len(cached) * self.block_size)
        in_pool = sum(1 for block_id in cached[:passed] if block_id in self._free)
        return super().num_blocks_to_admit(cached, num_new_tokens) - in_pool

    def adopt_prefix(self, request: Request, block_ids: list[int]) -> None:
        super().adopt_prefix(request, block_ids)
        self.register(request)

    def _num_passed(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the keys the next query (at `num_computed_tokens`) or any later one reads."""
        return max(0, (num_computed_tokens - self.window) // self.block_size)

    def register(self, request: Request) -> None:
        """Register the newly full blocks, then hand back those the window has passed. Called at every step
        boundary, after a speculative rollback, so `num_computed_tokens` counts only kept tokens. With a
        step in flight (overlapped steps on a GPU) it counts that step's tokens too: a block released now is
        written by another request only in a later step, after the step in flight has read it (stream
        order)."""
        super().register(request)
        released = self._num_passed(request.num_computed_tokens)
        start = request.num_released_blocks
        if released <= start:
            return
        table = request.block_table
        for block_id in table[start:released]:
            self._release(block_id)
        point_released(table, released)
        request.num_released_blocks = released


def windowed_reach(windows: tuple[int, ...]) -> int:
    """How far back any layer reads (the widest window) where every layer slides one; 0 where any is global."""
    return max(windows) if windows and all(windows) else 0
