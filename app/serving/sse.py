"""Server-sent events: the one framing, the response that sends them, and the contract between the two
paths a stream's events take to the socket.

Every event goes out by the slow path: the response iterates its body and sends each event through
ASGI `send`. A plain stream's events that carry only text may also take the fast path: written to the
connection from the engine's callback on the loop, while the stream's reader waits, so that no task is
woken and no generator or `send` layer crossed for them (at hundreds of streams those were much of
the event loop's time per token). `WriteThroughStream` states what both paths must keep;
`PlainStream` is its one implementation. The fast path rests on private parts of two packages
(pinned in pyproject.toml): uvicorn's httptools request cycle (transport.BodyWriter) and
sse-starlette's EventSourceResponse internals (`_SseResponse` below).
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable

from sse_starlette import EventSourceResponse
from starlette.types import Message, Receive, Scope, Send

from app.operations.front_door import BODY_SEND
from app.operations.sends import SendBatch
from app.operations.transport import BodyWriter
from app.serving.streaming import CompletionRenderer
from engine.types import Chunk

logger = logging.getLogger(__name__)


def sse_event(event_id: int, data: str, event: str | None = None) -> bytes:
    """One encoded SSE event, as sse-starlette encodes it with `sep="\\n"`; built here because its
    general encoder costs more per event than the rest of the stream's path. `data` is compact
    JSON or [DONE], never a line break, so it is one `data:` line."""
    if event is None:
        return f"id: {event_id}\ndata: {data}\n\n".encode()
    return f"event: {event}\nid: {event_id}\ndata: {data}\n\n".encode()


class WriteThroughStream(abc.ABC):
    """A stream whose events take two paths to one connection, as if they had taken one.

    Slow path: iterated by the response (`__aiter__`), every event sent through `send`.
    Fast path: given the connection (`write_through`), the stream sets the channel's callback
    (StreamChannel.write_through) and writes events from it. What must hold:
    1. Same bytes: an event written through is byte for byte the event the slow path would have
       sent for that chunk (its payload is `CompletionRenderer.content_delta`, which `events` yields for the
       chunk and nothing else), with an id from the count both paths share.
    2. Same order: the channel offers a chunk only while the slow path waits with nothing pending,
       so nothing written through overtakes an event handed to the slow path before it.
    3. Same back-pressure: writing through never waits; where `send` would wait, the connection
       refuses and the chunk takes the slow path, whose `send` waits for the client.
    4. Never silent: the fast path is taken wherever the server is uvicorn with httptools and no send
       timeout. tests/unit/test_fast_path.py checks 1 and 4 against a real uvicorn, test_channel.py 2,
       and tests/e2e/test_flow_control.py 3.
    """

    # Where the connection stages what it writes through (see app/operations/sends.py).
    sends: SendBatch | None = None

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[bytes]:
        """The slow path: every event the fast path did not write, numbered with the events it did."""

    @abc.abstractmethod
    def write_through(self, connection: BodyWriter) -> None:
        """Take the fast path on `connection` for the rest of the stream."""


class PlainStream(WriteThroughStream):
    """A stream that is not resumable: its SSE events numbered from 1, and the reader's disconnect
    cancels the request at once. Every chunk but those that carry only text (the role, a choice's
    last, logprobs, tool calls, usage, [DONE]), and any chunk the connection would have to wait for,
    goes the slow way."""

    def __init__(
        self, renderer: CompletionRenderer, live: dict[str, CompletionRenderer], sends: SendBatch | None = None
    ) -> None:
        self.renderer = renderer
        self.sends = sends
        self._live = live
        self._num_events = 0
        self._connection: BodyWriter | None = None
        self._events = self._numbered()

    def write_through(self, connection: BodyWriter) -> None:
        self._connection = connection
        self.renderer.channel.write_through = self._write

    def _write(self, chunk: Chunk) -> bool:
        written = False
        try:
            payload = self.renderer.content_delta(chunk)
            if payload is not None:
                written = self._connection.write(sse_event(self._num_events + 1, payload))
            if written:
                self._num_events += 1
                if self.renderer.accounting is not None:
                    self.renderer.accounting.on_chunk(chunk)
        except Exception:
            # This runs in the callback that delivers every stream's chunks of a step: a fault here
            # must not cost the others theirs. This stream goes the slow way from now on (a chunk
            # already written is not handed on again).
            logger.exception("writing a stream's event through failed; it goes through `send` from now on")
            self.renderer.channel.write_through = None
        return written

    def __aiter__(self) -> PlainStream:
        return self

    def __anext__(self) -> Awaitable[bytes]:
        return self._events.__anext__()

    def aclose(self) -> Awaitable[None]:
        return self._events.aclose()

    async def _numbered(self) -> AsyncGenerator[bytes]:
        renderer = self.renderer
        self._live[renderer.completion_id] = renderer
        payloads = renderer.events()
        try:
            async for data in payloads:
                self._num_events += 1
                yield sse_event(self._num_events, data)
        finally:
            # Close the inner generator now, not whenever it is collected: that cancels the request.
            await payloads.aclose()
            self._live.pop(renderer.completion_id, None)
            # The channel and this stream refer to each other through it: freed at once, not by the collector.
            renderer.channel.write_through = None


class _SseResponse(EventSourceResponse):
    """sse-starlette's response, minus a cancel scope around every send when no send timeout is
    set (a measurable share of the event loop's time per event under load), with the body's
    events sent straight to the front door's `send` (front_door.BODY_SEND) where there is one; and a
    WriteThroughStream body is given its connection.

    Its parts run as sse-starlette runs them (the stream, the client's disconnect, the server's
    exit signal and the pings; the first to end ends the others), but as plain asyncio tasks
    rather than in an anyio task group, whose scopes and checks were most of what the response cost
    the event loop on a short request (docs/design/host-path.md, "Cheap events"). NOTE: this calls
    sse-starlette's private members (`_stream_response`, `_listen_for_disconnect`,
    `_listen_for_exit_signal_with_grace`, `_ping`, `_ping_interval`, `_send_with_timeout`), hence its
    upper bound in pyproject.toml."""

    _body_send: Send | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._body_send = scope.get(BODY_SEND)
        body = self.body_iterator
        if isinstance(body, WriteThroughStream) and self._body_send is not None and self.send_timeout is None:
            if connection := BodyWriter.of(self._body_send, body.sends):
                body.write_through(connection)
        if scope["type"] != "http" or scope["method"] == "HEAD" or self.data_sender_callable is not None:
            await super().__call__(scope, receive, send)
            return
        parts = [
            asyncio.ensure_future(self._stream_response(send)),
            asyncio.ensure_future(self._listen_for_disconnect(receive)),
            asyncio.ensure_future(self._listen_for_exit_signal_with_grace()),
        ]
        if self._ping_interval > 0:
            parts.append(asyncio.ensure_future(self._ping(send)))
        try:
            done, _ = await asyncio.wait(parts, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for part in parts:
                part.cancel()
            await asyncio.gather(*parts, return_exceptions=True)
        # As the task group would: a part's failure is the response's (the stream's first).
        for part in parts:
            if part in done and not part.cancelled() and part.exception() is not None:
                raise part.exception()
        if self.background is not None:
            await self.background()

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        if self.send_timeout is not None:
            await super()._send_with_timeout(send, message)
        elif self._body_send is not None and message["type"] == "http.response.body":
            await self._body_send(message)
        else:
            await send(message)


# A keep-alive is one comment line with no blank line after it: a blank line ends an event, and the
# OpenAI Python SDK's reader, which keeps the last `id:` across events, turns a blank line after a
# comment into an event with empty data and fails to parse it (every Sluice event has an id, so any
# pause past the keep-alive after the first event broke SDK streams). SSE ignores comment lines
# wherever they stand, so a bare one keeps proxies busy and reaches no client as an event. (sse-starlette
# sends the factory's bytes as they are, through `ensure_bytes`.)
KEEPALIVE = b": ping\n"
# The OpenAPI document's 200 of a route that may answer with a stream: its events beside the JSON body.
STREAMED_200: dict[int | str, dict] = {
    200: {
        "description": "The JSON body, or with `stream` an event stream",
        "content": {
            "text/event-stream": {
                # One event, as a client's SSE parser yields it.
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {"event": {"type": "string"}, "id": {"type": "string"}, "data": {"type": "string"}},
                }
            }
        },
    }
}


def event_stream(events: AsyncIterator[bytes], keepalive_seconds: float) -> EventSourceResponse:
    """The SSE response, returned before the first token exists; a comment every
    `keepalive_seconds` keeps proxies from closing a quiet stream."""
    return _SseResponse(
        events,
        ping=keepalive_seconds,
        ping_message_factory=lambda: KEEPALIVE,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
