"""Live streams by completion id: explicit cancel for any, replay and resume for resumable ones.

A resumable stream is read from its channel by a task of its own into an event
log, so generation goes on while no client is connected; clients subscribe to
the log from any event id. Nobody subscribed for the resume window: the request
is cancelled (unless it has finished) and the log dropped. A finished stream is
kept that long too: the events a server writes, [DONE] included, can still be
lost on their way when the connection breaks, and the client then comes back for
them. A plain stream (app/serving/sse.py) is read by its response alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from app.operations.sends import SendBatch
from app.serving.event_log import EventLog
from app.serving.sse import PlainStream, sse_event
from app.serving.streaming import CompletionRenderer


class ResumableStream:
    """One resumable stream's numbered events (event i has id i + 1) and its subscribers."""

    def __init__(self, renderer: CompletionRenderer, registry: StreamRegistry) -> None:
        self.renderer = renderer
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
            async for data in self.renderer.events():
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
        self.renderer.channel.cancel()

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
        self._live: dict[str, CompletionRenderer] = {}
        self._resumable: dict[str, ResumableStream] = {}
        self._tasks: set[asyncio.Task] = set()

    def serve(self, renderer: CompletionRenderer, resumable: bool) -> AsyncIterator[bytes]:
        """The numbered SSE events of a new stream."""
        if not resumable:
            return PlainStream(renderer, self._live, self._sends)
        stream = ResumableStream(renderer, self)
        self._resumable[renderer.completion_id] = stream
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
        if renderer := self._live.get(completion_id):
            renderer.channel.cancel()
            return True
        return False

    def drop_all(self) -> None:
        """Cancel every resumable stream and forget its log (the last step of a drain)."""
        for stream in list(self._resumable.values()):
            stream.cancel()
            self.forget(stream)

    def holds(self, stream: ResumableStream) -> bool:
        return self._resumable.get(stream.renderer.completion_id) is stream

    def forget(self, stream: ResumableStream) -> None:
        if self.holds(stream):
            del self._resumable[stream.renderer.completion_id]
