"""The written-through fast path (app/serving/sse.py's WriteThroughStream) against a real uvicorn: it is
taken for every chunk that carries only text, and the bytes on the wire (chunked framing included) are
the slow path's, for chat, completions, n > 1, logprobs, usage, tool calls and errors."""

import asyncio
import socket
from dataclasses import dataclass

import pytest
import uvicorn

from app.operations.front_door import FrontDoor
from app.operations.transport import BodyWriter, bounded_http_protocol
from app.serving import tools
from app.serving.sse import PlainStream, event_stream
from app.serving.streaming import CompletionRenderer, Kind
from engine.channel import StreamChannel
from engine.detokenizer import TokenBytes
from engine.types import Chunk, FinishReason, Timings, TokenLogprob

TOKENS = TokenBytes([f"t{i} ".encode() for i in range(64)] + ["é".encode()])
TIMINGS = Timings(queue_ms=0.5, prompt_ms=1.25, ttft_ms=2.0, decode_ms=9.5, prompt_tokens=3, completion_tokens=4)


@dataclass(frozen=True)
class Case:
    kind: Kind
    num_choices: int = 1
    wants_logprobs: bool = False
    include_usage: bool = False
    parses_tools: bool = False
    error: bool = False

    def renderer(self) -> CompletionRenderer:
        return CompletionRenderer(
            kind=self.kind,
            model="m",
            num_prompt_tokens=3,
            num_choices=self.num_choices,
            wants_logprobs=self.wants_logprobs,
            include_usage=self.include_usage,
            channel=StreamChannel(asyncio.get_running_loop(), num_choices=self.num_choices),
            token_bytes=TOKENS,
            completion_id="cmpl-1",
            created=1700000000,
            parser=tools.ToolCallParser if self.parses_tools else None,
        )

    def chunks(self) -> list[Chunk]:
        texts = ["Hello", ' "world"\n', "é", "<tool_call>", '{"name": "f", "arguments": {}}', "</tool_call>", " end"]
        chunks = []
        for step, text in enumerate(texts):
            for index in range(self.num_choices):
                logprobs = (TokenLogprob(step, -0.25 * step, ((step, -0.25 * step), (64, -3.5))),)
                chunks.append(Chunk((step,), text, index, logprobs if self.wants_logprobs else ()))
        for index in range(self.num_choices):
            if self.error and index == 0:
                chunks.append(Chunk((), "", index, (), FinishReason.ERROR, "the engine failed"))
                break
            chunks.append(Chunk((9,), "!", index, (), FinishReason.STOP, None, TIMINGS))
        return chunks

    def written_through(self) -> int:
        """Chunks the fast path takes: every one that carries only text, up to an error."""
        if self.wants_logprobs or self.parses_tools:
            return 0
        return sum(not chunk.is_terminal and bool(chunk.text) for chunk in self.chunks())


CASES = {
    "chat": Case("chat"),
    "completions": Case("text"),
    "chat n=2 usage": Case("chat", num_choices=2, include_usage=True),
    "completions n=3 usage": Case("text", num_choices=3, include_usage=True),
    "chat logprobs": Case("chat", wants_logprobs=True),
    "completions logprobs n=2": Case("text", num_choices=2, wants_logprobs=True, include_usage=True),
    "chat tools": Case("chat", parses_tools=True, include_usage=True),
    "chat error": Case("chat", include_usage=True, error=True),
    "completions error n=2": Case("text", num_choices=2, error=True),
}


class Server:
    """uvicorn as `sluice` runs it (httptools, bounded writes, the front door) serving one stream at a
    time: a PlainStream as the routes serve it at /fast, and at /slow the same stream hidden behind a
    plain generator, so the response cannot give it its connection."""

    def __init__(self) -> None:
        self.renderer: CompletionRenderer | None = None
        self.make: Case | None = None

    async def app(self, scope, receive, send) -> None:
        self.renderer = self.make.renderer()
        stream = PlainStream(self.renderer, live={})
        if scope["path"] == "/slow":
            stream = (event async for event in stream)
        await event_stream(stream, keepalive_seconds=3600)(scope, receive, send)


@pytest.fixture
async def server():
    served = Server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(
        FrontDoor(served.app, max_request_bytes=1 << 20, metrics=lambda: None, audit=lambda: None),
        host="127.0.0.1",
        port=port,
        http=bounded_http_protocol(64 * 1024),
        lifespan="off",
        log_level="warning",
    )
    uv = uvicorn.Server(config)
    task = asyncio.create_task(uv.serve())
    while not uv.started:
        await asyncio.sleep(0.01)
    served.port = port
    yield served
    uv.should_exit = True
    await task


async def exchange(server: Server, path: str, case: Case) -> bytes:
    """The raw response body (chunked framing and all) with the case's chunks delivered one at a time,
    each once the client has what the previous one sent (the stream's reader then waits for more)."""
    server.make = case
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
    received = bytearray()

    async def grown() -> None:
        before = len(received)
        while len(received) == before:
            received.extend(await reader.read(65536))

    async def next_events() -> None:
        # A chunk the tool-call parser holds back sends nothing.
        try:
            await asyncio.wait_for(grown(), 0.5 if case.parses_tools else 30)
        except TimeoutError:
            assert case.parses_tools, "the stream sent nothing for a chunk"

    await grown()
    for chunk in case.chunks():
        server.renderer.channel.accept(chunk)
        server.renderer.channel.deliver(chunk)
        await next_events()
    while data := await reader.read(65536):
        received.extend(data)
    writer.close()
    head, body = bytes(received).split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    return body


@pytest.mark.parametrize("name", CASES)
async def test_the_fast_path_is_taken_and_sends_the_slow_paths_bytes(server, name, monkeypatch):
    case = CASES[name]
    written = []
    write = BodyWriter.write

    def counted(self, body: bytes) -> bool:
        taken = write(self, body)
        written.extend([body] * taken)
        return taken

    monkeypatch.setattr(BodyWriter, "write", counted)
    # A tool call's id is random: the same in both runs, so the bytes can be compared.
    monkeypatch.setattr(tools, "new_call_id", lambda: "call_0")
    slow = await exchange(server, "/slow", case)
    assert not written, "the slow path wrote through"
    fast = await exchange(server, "/fast", case)
    assert len(written) == case.written_through(), "the fast path was not taken for every text-only chunk"
    assert fast == slow
    assert fast.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
