"""Small per-connection write buffers, so a client that stops reading pushes back within kilobytes.

Left to defaults, the kernel grows a socket's send buffer to megabytes and asyncio
buffers 64 KiB more before uvicorn's `send` waits; a stalled reader would then
cost that much memory, and keep the engine generating, before back-pressure
reached its stream. Bounded here, the stream's own bound (`max_unread_tokens`)
takes over after a few kilobytes.

The parser is httptools when it is installed (uvicorn's own choice, and cheaper per
event than h11), else h11; both get the same bound.
"""

from __future__ import annotations

import asyncio
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed
    HttpToolsProtocol = None


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
