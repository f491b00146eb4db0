"""Live streams by completion id: explicit cancel for any, replay and resume for resumable ones.

A resumable stream is read from its channel by a task of its own into an event
log, so generation goes on while no client is connected; clients subscribe to
the log from any event id. Nobody subscribed for the resume window: the request
is cancelled (unless it has finished) and the log dropped. A finished stream is
kept that long too: the events a server writes, [DONE] included, can still be
lost on their way when the connection breaks, and the client then comes back for
them. A plain stream is read by its response alone, and writes its text deltas
straight to the connection where it can.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable

from app.operations.sends import SendBatch
from app.operations.transport import BodyWriter
from app.serving.event_log import EventLog
from app.serving.streaming import Generation, sse_event
from engine.channel import Chunk

logger = logging.getLogger(__name__)


class ResumableStream:
    """One resumable generation's numbered events (event i has id i + 1) and its subscribers."""

    def __init__(self, generation: Generation, registry: StreamRegistry) -> None:
        self.generation = generation
        self._registry = registry
        self._log: EventLog[str] = EventLog()
        self._subscribers = 0
        # Counting from now, not from the first reader's leaving: a response closed before it read its
        # first event never attaches, and the stream must expire all the same.
        self._expiry: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            registry.window_seconds, self._expire
        )

    @property
    def num_events(self) -> int:
        return len(self._log)

    @property
    def finished(self) -> bool:
        """Every event is in the log, [DONE] last."""
        return self._log.done

    async def run(self) -> None:
        """Read the whole generation into the log, whoever is listening."""
        try:
            async for data in self.generation.events():
                self._log.append(data)
        finally:
            self._log.close()

    async def subscribe(self, after: int) -> AsyncIterator[bytes]:
        """Every event after id `after`, then live ones until [DONE]."""
        self._attach()
        try:
            async for event_id, data in self._log.follow(after):
                yield sse_event(event_id, data)
        finally:
            self._detach()

    def cancel(self) -> None:
        self.generation.channel.cancel()

    def _attach(self) -> None:
        self._subscribers += 1
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def _detach(self) -> None:
        self._subscribers -= 1
        if not self._subscribers and self._registry.holds(self):
            self._expiry = asyncio.get_running_loop().call_later(self._registry.window_seconds, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        if not self._subscribers:
            if not self.finished:
                self.cancel()
            self._registry.forget(self)


class StreamRegistry:
    """Every streamed generation in flight, by completion id; owned by the event loop."""

    def __init__(self, window_seconds: float, sends: SendBatch | None = None) -> None:
        self.window_seconds = window_seconds
        self._sends = sends
        self._live: dict[str, Generation] = {}
        self._resumable: dict[str, ResumableStream] = {}
        self._tasks: set[asyncio.Task] = set()

    def serve(self, generation: Generation, resumable: bool) -> AsyncIterator[bytes]:
        """The numbered SSE events of a new stream."""
        if not resumable:
            return PlainStream(generation, self._live, self._sends)
        stream = ResumableStream(generation, self)
        self._resumable[generation.completion_id] = stream
        task = asyncio.get_running_loop().create_task(stream.run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return stream.subscribe(after=0)

    def resumable(self, completion_id: str) -> ResumableStream | None:
        return self._resumable.get(completion_id)

    def cancel(self, completion_id: str) -> bool:
        """Cancel a live stream of any kind, or forget a finished one kept for resuming; False when
        there is none by that id."""
        if stream := self._resumable.get(completion_id):
            if stream.finished:
                self.forget(stream)
            else:
                stream.cancel()
            return True
        if generation := self._live.get(completion_id):
            generation.channel.cancel()
            return True
        return False

    def drop_all(self) -> None:
        """Cancel every resumable stream and forget its log (the last step of a drain)."""
        for stream in list(self._resumable.values()):
            stream.cancel()
            self.forget(stream)

    def holds(self, stream: ResumableStream) -> bool:
        return self._resumable.get(stream.generation.completion_id) is stream

    def forget(self, stream: ResumableStream) -> None:
        if self.holds(stream):
            del self._resumable[stream.generation.completion_id]


class PlainStream:
    """A stream that is not resumable: its SSE events numbered from 1, and the reader's disconnect
    cancels the request at once.

    Given its connection (`write_through`, by the SSE response), the chunks that carry only text go
    out from the engine's callback while the reader waits (StreamChannel.write_through): at hundreds
    of streams, waking each stream's task and passing each event through the generators and `send`
    layers below took about a quarter of the event loop's time per token. Every other chunk (the role, a
    choice's last, logprobs, tool calls, usage, [DONE]), and any chunk the connection would have to
    wait for, goes the general way, through `events` and `send`, numbered from the same count.
    """

    def __init__(self, generation: Generation, live: dict[str, Generation], sends: SendBatch | None = None) -> None:
        self.generation = generation
        # Where the response's BodyWriter stages what it writes through (see app/operations/sends.py).
        self.sends = sends
        self._live = live
        self._num_events = 0
        self._body: BodyWriter | None = None
        self._events = self._numbered()

    def write_through(self, body: BodyWriter) -> None:
        self._body = body
        self.generation.channel.write_through = self._write

    def _write(self, chunk: Chunk) -> bool:
        written = False
        try:
            payload = self.generation.content_delta(chunk)
            if payload is not None:
                written = self._body.write(sse_event(self._num_events + 1, payload))
            if written:
                self._num_events += 1
                if self.generation.accounting is not None:
                    self.generation.accounting.on_chunk(chunk)
        except Exception:
            # This runs in the callback that delivers every stream's chunks of a step: a fault here
            # must not cost the others theirs. This stream goes the general way from now on (a chunk
            # already written is not handed on again).
            logger.exception("writing a stream's event through failed; it goes through `send` from now on")
            self.generation.channel.write_through = None
        return written

    def __aiter__(self) -> PlainStream:
        return self

    def __anext__(self) -> Awaitable[bytes]:
        return self._events.__anext__()

    def aclose(self) -> Awaitable[None]:
        return self._events.aclose()

    async def _numbered(self) -> AsyncGenerator[bytes]:
        generation = self.generation
        self._live[generation.completion_id] = generation
        payloads = generation.events()
        try:
            async for data in payloads:
                self._num_events += 1
                yield sse_event(self._num_events, data)
        finally:
            # Close the inner generator now, not whenever it is collected: that cancels the request.
            await payloads.aclose()
            self._live.pop(generation.completion_id, None)
            # The channel and this stream refer to each other through it: freed at once, not by the collector.
            generation.channel.write_through = None
