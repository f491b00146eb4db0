"""SendBatch: the chunks that one event-loop callback writes to many connections, sent together in one
native call with the GIL released.

A streamed chunk's send is a system call that, on loopback, also runs the receiver's side of TCP:
with uvloop it runs holding the GIL, and at hundreds of streams those sends were about a third of
the event loop's GIL-held time (py-spy --gil, 256 streams). Where the engine thread runs Python while
the accelerator computes, that is time the engine waits. Batched, the loop hands the GIL over once per
step while a step's chunks go out, and takes it back once.

Order per connection is kept: a chunk goes straight to the socket only while its transport holds
nothing unsent, whatever the socket does not take is handed to the transport in order (which then
sends it when the socket drains and applies its back-pressure as for any write), and a connection
that is closing gets nothing. Chunks are staged during the callback and sent by a callback queued
behind it, so a stream's own later events (woken by the same step) come after them.
"""

from __future__ import annotations

import asyncio
import ctypes
from array import array
from pathlib import Path

from engine.kernels.cpu.native import build_shared_library

_SOURCE = Path(__file__).with_name("sends.cpp")
_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")


class SendBatch:
    """Writes staged on the event loop and sent in one call at the end of the loop's current callbacks."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._send_all = library.sl_send_all
        self._send_all.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p]
        self._send_all.restype = None
        self._staged: list[tuple[asyncio.Transport, int, bytes]] = []

    @classmethod
    def build(cls, cache_dir: Path) -> SendBatch | None:
        """None where the library cannot be built: each chunk is then its transport's own write."""
        target = build_shared_library(cache_dir, "the batched socket sends", (_SOURCE,), (), _FLAGS)
        return cls(ctypes.CDLL(str(target))) if target is not None else None

    def stage(self, transport: asyncio.Transport, fd: int, data: bytes) -> None:
        """Queue `data` for `transport`, whose socket is `fd`; only on the event loop."""
        if not self._staged:
            asyncio.get_running_loop().call_soon(self.send)
        self._staged.append((transport, fd, data))

    def send(self) -> None:
        staged, self._staged = self._staged, []
        direct: list[tuple[asyncio.Transport, bytes]] = []
        fds, lengths = array("i"), array("q")
        for transport, fd, data in staged:
            if transport.is_closing():
                continue
            if transport.get_write_buffer_size():
                # Behind what the transport holds; this also keeps the connection's later entries
                # behind this one, since the transport now holds it.
                transport.write(data)
                continue
            direct.append((transport, data))
            fds.append(fd)
            lengths.append(len(data))
        if not direct:
            return
        sent = array("q", bytes(8 * len(direct)))
        joined = b"".join([data for _, data in direct])
        self._send_all(len(direct), fds.buffer_info()[0], joined, lengths.buffer_info()[0], sent.buffer_info()[0])
        for (transport, data), taken in zip(direct, sent):
            if taken < len(data):
                transport.write(data[taken:])
