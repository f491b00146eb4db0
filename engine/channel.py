"""StreamChannel and Outbox: the only way data travels between the engine thread and the event loop.

The engine stages every chunk of a step in the Outbox and hands them over in one
`call_soon_threadsafe` per event loop, so the loop wakes once per step, not once per
stream: with hundreds of streams a wake-up each would cost more than the step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from engine.types import Chunk


class StreamChannel:
    """Engine → loop chunks plus two signals back: the cancel flag and how far the reader got.

    Keeps the terminal guarantee: after a choice's terminal chunk nothing more is
    delivered for it, and the reader stops after the last choice's.
    A reader that falls behind gets its pending chunks merged into one per choice (more where
    a reasoning follows text: see _coalesce), never dropped or reordered, and the scheduler
    pauses the request while `unread_tokens` is past its bound.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, num_choices: int = 1) -> None:
        self.loop = loop
        # Delivered and not yet read, and the reader's wake-up while it waits for more. A list and a
        # future rather than an asyncio.Queue: this runs once per token of every stream.
        self._delivered: list[Chunk] = []
        self._waiter: asyncio.Future[None] | None = None
        self._cancelled = threading.Event()
        self._num_choices = num_choices
        self._open_choices = set(range(num_choices))
        # Written by one thread each; reads of a Python int from the other are atomic.
        self._pushed_tokens = 0
        self._read_tokens = 0
        # A reader that can take some chunks itself, on the loop, without being woken: the fast path of
        # app/serving/sse.py's WriteThroughStream, whose contract this keeps. Offered a chunk only while
        # the reader waits with nothing pending, so nothing overtakes what it was handed before; returns
        # whether it took the chunk, and a chunk taken is counted as read.
        self.write_through: Callable[[Chunk], bool] | None = None
        # Called on the loop by cancel(): where no engine thread reads the flag (a remote engine's relay,
        # app/cluster/pool.py), how the cancel reaches the engine.
        self.on_cancel: Callable[[], None] | None = None

    # Engine thread side.

    def accept(self, chunk: Chunk) -> bool:
        """Count a chunk about to cross to the reader; False once the choice's terminal went out."""
        if chunk.index not in self._open_choices:
            return False
        if chunk.is_terminal:
            self._open_choices.discard(chunk.index)
        self._pushed_tokens += len(chunk.token_ids)
        return True

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def unread_tokens(self) -> int:
        return self._pushed_tokens - self._read_tokens

    @property
    def read_tokens(self) -> int:
        """Tokens the reader has taken, every choice's, written through or iterated."""
        return self._read_tokens

    # Event loop side.

    def cancel(self) -> None:
        """Ask the engine to stop this request; it frees the KV blocks at its next step."""
        self._cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        open_choices = self._num_choices
        while open_choices:
            if not self._delivered:
                self._waiter = self.loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            chunks, self._delivered = self._delivered, []
            for chunk in chunks if len(chunks) == 1 else _coalesce(chunks):
                self._read_tokens += len(chunk.token_ids)
                open_choices -= chunk.is_terminal
                yield chunk

    def deliver(self, chunk: Chunk) -> None:
        """Called by the Outbox's callback on the loop: hand a chunk to the reader."""
        waiter = self._waiter
        # A waiter not yet done means nothing is pending: the first chunk queued wakes it.
        waiting = waiter is not None and not waiter.done()
        if waiting and self.write_through is not None and self.write_through(chunk):
            self._read_tokens += len(chunk.token_ids)
            return
        self._delivered.append(chunk)
        if waiting:
            waiter.set_result(None)


def _coalesce(chunks: list[Chunk]) -> list[Chunk]:
    """Chunks a reader fell behind on, merged per choice in first-seen order: one new chunk per choice,
    however many it merges (a lagging reader's loop has no time to spare), but where a chunk's reasoning
    follows text of the merge (a harmony analysis after a preamble), which a merged chunk would show first:
    that chunk starts the choice's next merge."""
    by_choice: dict[int, list[Chunk]] = {}
    for chunk in chunks:
        by_choice.setdefault(chunk.index, []).append(chunk)
    merged: list[Chunk] = []
    for group in by_choice.values():
        if len(group) == 1:
            merged.append(group[0])
        elif not any(chunk.reasoning for chunk in group):
            merged.append(Chunk.joined(group))
        else:
            merged += [Chunk.joined(run) for run in _runs_in_order(group)]
    return merged


def _runs_in_order(group: list[Chunk]) -> list[list[Chunk]]:
    """A choice's chunks cut before each one whose reasoning follows text of the run so far."""
    runs: list[list[Chunk]] = [[]]
    has_text = False
    for chunk in group:
        if chunk.reasoning and has_text:
            runs.append([])
            has_text = False
        runs[-1].append(chunk)
        has_text = has_text or bool(chunk.text)
    return runs


class Outbox:
    """Chunks staged by the engine during a step, delivered at its end in one crossing per loop.

    Staging is locked because two other paths stage from the loop's thread (a request
    submitted after shutdown began, and shutdown itself); a channel's chunks are staged
    and flushed in order, so its reader sees them in order.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: list[tuple[StreamChannel, Chunk]] = []

    def stage(self, channel: StreamChannel, chunk: Chunk) -> None:
        if channel.accept(chunk):
            with self._lock:
                self._staged.append((channel, chunk))

    def flush(self) -> None:
        """Hand everything staged to its event loop without waiting."""
        with self._lock:
            if not self._staged:
                return
            staged, self._staged = self._staged, []
            by_loop: dict[asyncio.AbstractEventLoop, list[tuple[StreamChannel, Chunk]]] = {}
            for channel, chunk in staged:
                by_loop.setdefault(channel.loop, []).append((channel, chunk))
            for loop, batch in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_deliver, batch)
                except RuntimeError:
                    # The loop is closed: its readers are gone with it, so there is nobody to unblock.
                    pass


def _deliver(batch: list[tuple[StreamChannel, Chunk]]) -> None:
    for channel, chunk in batch:
        channel.deliver(chunk)
