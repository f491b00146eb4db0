"""SendBatch: staged chunks reach each socket whole and in order, whether the socket takes them at
once, in part, or the transport already holds bytes; a closing connection gets none."""

import asyncio
import socket
from contextlib import asynccontextmanager

import pytest
import uvloop

from app.operations.sends import SendBatch
from tests.conftest import CACHE_DIR


@pytest.fixture(scope="module")
def sends():
    built = SendBatch.build(CACHE_DIR)
    if built is None:
        pytest.skip("no C++ compiler to build the batched sends")
    return built


class Reader(asyncio.Protocol):
    def __init__(self) -> None:
        self.data = bytearray()

    def data_received(self, data: bytes) -> None:
        self.data += data


@asynccontextmanager
async def connections(count: int, send_buffer: int | None = None):
    """`count` client transports and, for each, the server side's received bytes; closed after."""
    loop = asyncio.get_running_loop()
    readers: list[Reader] = []

    def accept() -> Reader:
        readers.append(Reader())
        return readers[-1]

    server = await loop.create_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transports = []
    for _ in range(count):
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        if send_buffer is not None:
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        transports.append(transport)
    while len(readers) < count:
        await asyncio.sleep(0.01)
    try:
        yield transports, readers
    finally:
        for transport in transports:
            transport.close()
        server.close()


def fd(transport: asyncio.Transport) -> int:
    return transport.get_extra_info("socket").fileno()


async def until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def on_both_loops(test):
    """Run the coroutine on asyncio's own loop and on uvloop's (the server's)."""

    def run(sends):
        for factory in (asyncio.new_event_loop, uvloop.new_event_loop):
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(test(sends))

    run.__name__ = test.__name__
    return run


@on_both_loops
async def test_staged_chunks_arrive_in_order_before_what_the_connection_writes_after(sends):
    async with connections(8) as (transports, readers):
        for step in range(3):
            for i, transport in enumerate(transports):
                sends.stage(transport, fd(transport), f"<{i}.{step}a>".encode())
                sends.stage(transport, fd(transport), f"<{i}.{step}b>".encode())
            # Queued behind the batch's send, as a stream's own event woken by the same step is.
            asyncio.get_running_loop().call_soon(lambda s=step: [t.write(f"<{s}z>".encode()) for t in transports])
            await asyncio.sleep(0)
        expected = ["".join(f"<{i}.{s}a><{i}.{s}b><{s}z>" for s in range(3)).encode() for i in range(8)]
        await until(lambda: [bytes(r.data) for r in readers] == expected)


@on_both_loops
async def test_what_a_full_socket_does_not_take_follows_through_the_transport_in_order(sends):
    # A small send buffer and a reader that is not reading yet: the first send is short.
    async with connections(2, send_buffer=4096) as (transports, readers):
        big = [bytes([65 + i]) * 300_000 for i in range(2)]
        for i, transport in enumerate(transports):
            sends.stage(transport, fd(transport), big[i])
            sends.stage(transport, fd(transport), b"after-in-the-same-batch")
        await asyncio.sleep(0)
        # The transport holds the rest now: a chunk staged in a later step must go behind it.
        assert all(t.get_write_buffer_size() > 0 for t in transports)
        for transport in transports:
            sends.stage(transport, fd(transport), b"|next-step")
        await asyncio.sleep(0)
        expected = [big[i] + b"after-in-the-same-batch|next-step" for i in range(2)]
        await until(lambda: [bytes(r.data) for r in readers] == expected)


@on_both_loops
async def test_a_closing_connection_gets_nothing_and_the_others_are_served(sends):
    async with connections(3) as (transports, readers):
        transports[1].close()
        for i, transport in enumerate(transports):
            sends.stage(transport, fd(transport), f"chunk{i}".encode())
        await asyncio.sleep(0)
        await until(lambda: bytes(readers[0].data) == b"chunk0" and bytes(readers[2].data) == b"chunk2")
        await asyncio.sleep(0.05)
        assert bytes(readers[1].data) == b""
