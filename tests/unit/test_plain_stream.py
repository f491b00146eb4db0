"""PlainStream: events written through and events sent by the response share one numbering, the usage
counts every token, and a fault while writing through costs no event."""

import asyncio

from app.serving.sse import PlainStream
from app.serving.streaming import CompletionRenderer
from app.sse_reader import Event, parse_events, stream_text
from engine.channel import StreamChannel
from engine.detokenizer import TokenBytes
from engine.types import Chunk, FinishReason


class Connection:
    """Stands in for BodyWriter: takes every chunk while `open`, or raises once `broken`. Both the
    written-through events and the response's own land in `wire`, in the order they went out."""

    def __init__(self) -> None:
        self.open = True
        self.broken = False
        self.wire: list[bytes] = []
        self.written_through = 0

    def write(self, body: bytes) -> bool:
        if self.broken:
            raise OSError("the connection broke")
        if not self.open:
            return False
        self.wire.append(body)
        self.written_through += 1
        return True


def renderer(loop: asyncio.AbstractEventLoop) -> CompletionRenderer:
    return CompletionRenderer(
        kind="chat",
        model="m",
        num_prompt_tokens=3,
        num_choices=1,
        wants_logprobs=False,
        include_usage=True,
        channel=StreamChannel(loop),
        token_bytes=TokenBytes([]),
        completion_id="chatcmpl-1",
    )


def events(wire: list[bytes]) -> list[Event]:
    return parse_events(b"".join(wire).decode().split("\n"))


async def serve(stream: PlainStream, connection: Connection, chunks: list[Chunk], before_each=None) -> list[bytes]:
    """Read the stream as the SSE response does, delivering `chunks` one loop turn apart."""

    async def respond() -> None:
        async for event in stream:
            connection.wire.append(event)

    channel = stream.renderer.channel
    response = asyncio.create_task(respond())
    for i, c in enumerate(chunks):
        await asyncio.sleep(0)
        if before_each is not None:
            before_each(i)
        channel.accept(c)
        channel.deliver(c)
    await response
    return connection.wire


def text_chunks(count: int) -> list[Chunk]:
    *body, last = [Chunk((i,), f"t{i} ") for i in range(count)]
    return [*body, last._replace(finish_reason=FinishReason.LENGTH)]


async def test_written_through_and_sent_events_share_one_numbering_and_the_usage_counts_all():
    loop = asyncio.get_running_loop()
    connection, gen = Connection(), renderer(loop)
    stream = PlainStream(gen, live={})
    stream.write_through(connection)
    # The connection refuses chunks 3 and 4 (as when the client lags): they take the general way.
    wire = await serve(stream, connection, text_chunks(8), lambda i: setattr(connection, "open", i not in (3, 4)))
    numbered = events(wire)
    assert [e.id for e in numbered] == [str(i) for i in range(1, len(numbered) + 1)]
    assert numbered[-1].data == "[DONE]"
    assert numbered[-2].json()["usage"]["completion_tokens"] == 8
    assert stream_text(numbered)[0] == "".join(f"t{i} " for i in range(8))
    # 0-2 and 5-6 written through; the role, 3, 4, the last chunk, usage and [DONE] sent.
    assert connection.written_through == 5
    assert gen.channel.write_through is None, "the channel still holds the finished stream"


async def test_a_fault_while_writing_through_costs_no_event():
    loop = asyncio.get_running_loop()
    connection, gen = Connection(), renderer(loop)
    stream = PlainStream(gen, live={})
    stream.write_through(connection)
    wire = await serve(stream, connection, text_chunks(6), lambda i: setattr(connection, "broken", i == 2))
    # Chunks 0 and 1 went through; the fault at 2 detached the stream, so 3 and 4 were sent.
    assert connection.written_through == 2
    numbered = events(wire)
    assert [e.id for e in numbered] == [str(i) for i in range(1, len(numbered) + 1)]
    assert stream_text(numbered)[0] == "".join(f"t{i} " for i in range(6))
