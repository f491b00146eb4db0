"""StreamChannel: the only way data travels from the engine thread to the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.request import FinishReason


@dataclass(frozen=True)
class Chunk:
    """What one engine step produced for one request."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def is_terminal(self) -> bool:
        return self.finish_reason is not None


class StreamChannel:
    """Engine → loop chunk queue plus the loop → engine cancel flag.

    Keeps the terminal guarantee: after the first terminal chunk nothing more is
    delivered, so every reader sees exactly one and then stops.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._closed = False

    # Engine thread side.

    def push(self, chunk: Chunk) -> None:
        """Hand a chunk to the loop without waiting; a no-op once the terminal chunk went out."""
        if self._closed:
            return
        self._closed = chunk.is_terminal
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)
        except RuntimeError:
            # The loop is closed: the reader is gone with it, so there is nobody to unblock.
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # Event loop side.

    def cancel(self) -> None:
        """Ask the engine to stop this request; it frees the KV blocks at its next step."""
        self._cancelled.set()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        while True:
            chunk = await self._queue.get()
            yield chunk
            if chunk.is_terminal:
                return
