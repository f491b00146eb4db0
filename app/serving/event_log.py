"""EventLog: a stream's events kept in order, so readers can join, leave and come back from any point."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class EventLog(Generic[T]):
    """Appended to by one producer on the event loop, read by any number of followers."""

    def __init__(self) -> None:
        self.items: list[T] = []
        self.done = False
        # Replaced on every append: a follower awaits the one it saw, so no append is missed.
        self._grew = asyncio.Event()

    def __len__(self) -> int:
        return len(self.items)

    def append(self, item: T) -> None:
        self.items.append(item)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    async def follow(self, after: int) -> AsyncIterator[tuple[int, T]]:
        """(position from 1, item) of every item past the first `after`, then live ones until closed."""
        delivered = after
        while True:
            grew = self._grew
            while delivered < len(self.items):
                delivered += 1
                yield delivered, self.items[delivered - 1]
            if self.done:
                return
            await grew.wait()

    def _wake(self) -> None:
        self._grew.set()
        self._grew = asyncio.Event()
