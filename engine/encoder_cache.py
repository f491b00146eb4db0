"""EncoderCache: images' embeddings by content hash, so the vision tower runs once per distinct image."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """The vision tower's outputs ([rows, hidden] each) by ImageInput.content_hash, least recently used
    dropped first once they hold more than `max_rows` rows. An image's embeddings depend on the image
    alone, so a dropped one computed again has the same bits: the cache saves work, never changes
    outputs. It serves a request's n choices, its recomputation after preemption, and later requests
    that send the same image (a conversation's next turn, a retry)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._num_rows = 0
        # Images looked up as a request starts computing their tokens, and how many were found (the hit rate).
        self.num_queries = 0
        self.num_hits = 0

    def get(self, content_hash: int, num_queries: int = 1) -> torch.Tensor | None:
        """The image's embeddings, if kept. `num_queries`: how many requests this lookup serves in the hit
        rate (0 for a request's later chunks of an image it has begun); all but the first are hits if not kept,
        since they share the one encoding."""
        embeddings = self._entries.get(content_hash)
        self.num_queries += num_queries
        self.num_hits += num_queries if embeddings is not None else max(0, num_queries - 1)
        if embeddings is not None:
            self._entries.move_to_end(content_hash)
        return embeddings

    def __contains__(self, content_hash: object) -> bool:
        """Whether the image's embeddings are kept (not a lookup: the hit rate and the order stay)."""
        return content_hash in self._entries

    def put(self, content_hash: int, embeddings: torch.Tensor) -> None:
        """Keep `embeddings`; an image larger than the whole cache is still kept, alone, until the next put."""
        if content_hash in self._entries:
            return
        self._entries[content_hash] = embeddings
        self._num_rows += embeddings.shape[0]
        while self._num_rows > self.max_rows and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self._num_rows -= dropped.shape[0]

    @property
    def num_rows(self) -> int:
        return self._num_rows
