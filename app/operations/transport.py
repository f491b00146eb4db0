"""Small per-connection write buffers, so a client that stops reading pushes back within kilobytes;
and BodyWriter, a streamed body's chunks written straight to the connection.

Left to defaults, the kernel grows a socket's send buffer to megabytes and asyncio
buffers 64 KiB more before uvicorn's `send` waits; a stalled reader would then
cost that much memory, and keep the engine generating, before back-pressure
reached its stream. Bounded here, the stream's own bound (`max_unread_tokens`)
takes over after a few kilobytes.

The parser is httptools when it is installed (uvicorn's own choice, and cheaper per
event than h11), else h11; both get the same bound.

BodyWriter writes what uvicorn's `send` would for a body message of a chunked response,
without the ASGI call: the connection of the fast path (app/serving/sse.py's
WriteThroughStream, whose contract it keeps). It writes only where `send` would not wait (the
transport below its high-water mark, the client connected) and otherwise says no, so the
stream falls back to `send`, which waits for the client as before: back-pressure is unchanged.
NOTE: it reads uvicorn's private request cycle, hence uvicorn's upper bound in pyproject.toml.
"""

from __future__ import annotations

import asyncio
import socket

from starlette.types import Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.operations.sends import SendBatch

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as HttpToolsCycle
except ImportError:  # httptools is not installed
    HttpToolsProtocol = HttpToolsCycle = None


def bounded_http_protocol(write_buffer_bytes: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the socket send buffer and the transport's high-water
    mark both set to `write_buffer_bytes`."""
    base = HttpToolsProtocol or H11Protocol

    class BoundedHTTPProtocol(base):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, write_buffer_bytes)
            transport.set_write_buffer_limits(high=write_buffer_bytes)

    return BoundedHTTPProtocol


class BodyWriter:
    """Chunks of one chunked response body, written to its connection as uvicorn's httptools
    `send` writes them (`<hex length>\\r\\n<body>\\r\\n`), while `send` would not wait; staged in
    a SendBatch where there is one and the connection is a plain socket (not TLS)."""

    def __init__(self, cycle: HttpToolsCycle, sends: SendBatch | None = None) -> None:
        self._cycle = cycle
        transport = cycle.transport
        sock = transport.get_extra_info("socket")
        plain = sock is not None and transport.get_extra_info("sslcontext") is None
        self._sends = sends if plain else None
        self._fd = sock.fileno() if plain else -1

    @classmethod
    def of(cls, send: Send, sends: SendBatch | None = None) -> BodyWriter | None:
        """The writer behind uvicorn's own `send`; None for any other (h11, a wrapped `send`, a test
        client), whose streams keep to `send` alone."""
        cycle = getattr(send, "__self__", None)
        if HttpToolsCycle is None or type(cycle) is not HttpToolsCycle:
            return None
        return cls(cycle, sends)

    def write(self, body: bytes) -> bool:
        """Write one chunk of the body; False, having written nothing, where `send` would wait for the
        client or could not write (the response not started or complete, not chunked, the client gone)."""
        cycle = self._cycle
        if (
            cycle.flow.write_paused
            or cycle.disconnected
            or not cycle.response_started
            or cycle.response_complete
            or cycle.chunked_encoding is not True
            or cycle.transport.is_closing()
        ):
            return False
        framed = b"%x\r\n%b\r\n" % (len(body), body)
        if self._sends is not None:
            self._sends.stage(cycle.transport, self._fd, framed)
        else:
            cycle.transport.write(framed)
        return True
