"""The SSE response's parts (stream, disconnect listener, exit signal, pings) as plain asyncio tasks:
the first to end ends the others, a failure is the response's, and nothing is left running."""

import asyncio
import json

import httpx
import openai
import pytest

from app.serving.sse import event_stream

SCOPE = {"type": "http", "method": "POST", "headers": []}


class Client:
    """The ASGI side: records what the response sends; `leave()` makes `receive` report a disconnect."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self._gone = asyncio.Event()

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def receive(self) -> dict:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self._gone.set()

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def others() -> set[asyncio.Task]:
    """Tasks still running besides this test's own and sse-starlette's exit-signal watcher (one per
    loop, shared by every response)."""
    return {
        task
        for task in asyncio.all_tasks()
        if task is not asyncio.current_task() and task.get_coro().__qualname__ != "_shutdown_watcher"
    }


async def test_a_finished_stream_ends_its_body_and_leaves_no_task_behind():
    async def events():
        yield b"id: 1\ndata: a\n\n"
        yield b"id: 2\ndata: b\n\n"

    client = Client()
    await event_stream(events(), keepalive_seconds=15)(SCOPE, client.receive, client.send)
    assert client.sent[0]["type"] == "http.response.start"
    assert client.bodies() == [b"id: 1\ndata: a\n\n", b"id: 2\ndata: b\n\n", b""]
    assert client.sent[-1]["more_body"] is False
    await asyncio.sleep(0)
    assert not others()


async def test_a_disconnect_cancels_the_body_and_ends_the_response():
    closed = asyncio.Event()

    async def events():
        try:
            yield b"id: 1\ndata: a\n\n"
            await asyncio.Event().wait()  # the next token never comes
        finally:
            closed.set()

    client = Client()
    response = asyncio.create_task(event_stream(events(), keepalive_seconds=15)(SCOPE, client.receive, client.send))
    while len(client.bodies()) < 1:
        await asyncio.sleep(0.01)
    client.leave()
    await asyncio.wait_for(response, timeout=5)
    assert closed.is_set()
    assert client.bodies() == [b"id: 1\ndata: a\n\n"]
    await asyncio.sleep(0)
    assert not others()


async def test_a_failing_body_is_the_response_s_failure():
    async def events():
        yield b"id: 1\ndata: a\n\n"
        raise ValueError("the body broke")

    client = Client()
    with pytest.raises(ValueError, match="the body broke"):
        await event_stream(events(), keepalive_seconds=15)(SCOPE, client.receive, client.send)
    await asyncio.sleep(0)
    assert not others()


async def test_pings_flow_while_the_body_waits_and_stop_with_it():
    async def events():
        await asyncio.sleep(0.35)
        yield b"id: 1\ndata: a\n\n"

    client = Client()
    await event_stream(events(), keepalive_seconds=0.1)(SCOPE, client.receive, client.send)
    bodies = client.bodies()
    assert bodies[-2:] == [b"id: 1\ndata: a\n\n", b""]
    assert len([b for b in bodies if b.startswith(b": ping")]) >= 2
    await asyncio.sleep(0)
    assert not others()


async def test_a_keepalive_after_an_event_is_no_event_to_the_openai_sdk():
    """The SDK's reader keeps the last `id:` across events, so a comment followed by a blank line after
    an event became an event with empty data that it failed to parse as JSON."""
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}

    async def events():
        first = {**chunk, "choices": [{"index": 0, "delta": {"content": "a"}}]}
        yield f"id: 1\ndata: {json.dumps(first)}\n\n".encode()
        await asyncio.sleep(0.35)
        yield b"id: 2\ndata: [DONE]\n\n"

    client = Client()
    await event_stream(events(), keepalive_seconds=0.1)(SCOPE, client.receive, client.send)
    body = b"".join(client.bodies())
    assert body.count(b": ping") >= 2

    def replay(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    transport = httpx.MockTransport(replay)
    sdk = openai.OpenAI(api_key="x", base_url="http://sluice/v1", http_client=httpx.Client(transport=transport))
    stream = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert [c.choices[0].delta.content for c in stream] == ["a"]
