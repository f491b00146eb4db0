"""Raw SSE on the wire, curl -N, concurrency, disconnects and faults against a real server."""

import asyncio
import json
import shutil
import subprocess
import time

import httpx
import pytest

from app.sse_reader import read_events, stream_text
from tests.e2e.conftest import blocks_held

pytestmark = pytest.mark.slow


def chat_body(model, content, max_tokens=24, **extra):
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **extra,
    }


def test_sse_wire_format(server, model_name):
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=chat_body(model_name, "Hi"), timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = read_events(r)
    assert events[-1].data == "[DONE]"
    assert [e.id for e in events] == [str(i) for i in range(1, len(events) + 1)]
    first = events[0].json()
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    payloads = [e.json() for e in events[:-1]]
    finishing = [p for p in payloads if p["choices"][0]["finish_reason"]]
    assert len(finishing) == 1 and finishing[0] is payloads[-1]
    assert finishing[0]["choices"][0]["delta"] == {}
    assert len({p["id"] for p in payloads}) == 1


def test_headers_arrive_before_the_first_token(server, model_name):
    # A long generation is running; a new stream's headers must not wait for any token.
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", json=chat_body(model_name, "Count to 100", 200), timeout=60
    ) as busy:
        next(busy.iter_lines())
        start = time.monotonic()
        with httpx.stream(
            "POST", f"{server}/v1/chat/completions", json=chat_body(model_name, "Hello", 4), timeout=60
        ) as r:
            assert r.status_code == 200
            header_latency = time.monotonic() - start
            events = read_events(r)
    assert header_latency < 0.5
    assert events[-1].data == "[DONE]"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_tokens(server, model_name):
    out = subprocess.run(
        [
            "curl",
            "-sN",
            f"{server}/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(chat_body(model_name, "Say hello", 10)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    data = [line[len("data: ") :] for line in out.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert sum(1 for d in data[:-1] if json.loads(d)["choices"][0]["delta"].get("content")) >= 3


async def _stream_chat(client, server, body):
    async with client.stream("POST", f"{server}/v1/chat/completions", json=body) as r:
        lines = [line async for line in r.aiter_lines()]
    events = read_events(_Lines(lines))
    assert events[-1].data == "[DONE]"
    return stream_text(events)


class _Lines:
    def __init__(self, lines):
        self._lines = lines

    def iter_lines(self):
        return iter(self._lines + [""])


PROMPTS = [
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "List three fruits.",
    "Explain gravity briefly.",
    "Give me a synonym for happy.",
    "What is the capital of Japan?",
    "Describe a cat.",
    "Name a planet.",
    "Translate 'thank you' to Spanish.",
    "What color is the sky?",
    "Tell me a fun fact.",
    "What is Python?",
    "Suggest a book title.",
    "How many legs does a spider have?",
    "Write one line of a poem.",
    "Define entropy.",
]


async def test_sixteen_concurrent_streams_match_each_request_alone(server, model_name, health):
    before = blocks_held(health())
    async with httpx.AsyncClient(timeout=300) as client:
        alone = [await _stream_chat(client, server, chat_body(model_name, p, 24)) for p in PROMPTS]
        together = await asyncio.gather(*[_stream_chat(client, server, chat_body(model_name, p, 24)) for p in PROMPTS])
    assert together == alone
    assert all(text and reason in ("stop", "length") for text, reason in alone)
    assert blocks_held(health()) == before


async def test_disconnect_frees_kv_blocks_and_spares_other_streams(server, model_name, health):
    # Batch-invariant, so the surviving stream's text cannot change with the batch it shares.
    baseline = blocks_held(health())
    async with httpx.AsyncClient(timeout=120) as client:
        expected = await _stream_chat(client, server, chat_body(model_name, "Describe the moon.", 32))
        other = asyncio.create_task(_stream_chat(client, server, chat_body(model_name, "Describe the moon.", 32)))
        async with client.stream(
            "POST",
            f"{server}/v1/chat/completions",
            json=chat_body(model_name, "Write a long story about dragons.", 1000),
        ) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 5:
                    break
            assert health()["num_running"] >= 1
        # Leaving the block closed the connection mid-stream.
        deadline = time.monotonic() + 10
        while (await asyncio.to_thread(health))["num_running"] > (0 if other.done() else 1):
            assert time.monotonic() < deadline, "the disconnected request kept running"
            await asyncio.sleep(0.05)
        assert await other == expected
    deadline = time.monotonic() + 10
    while blocks_held(health()) != baseline:
        assert time.monotonic() < deadline
        time.sleep(0.05)


async def test_fault_in_a_step_ends_live_streams_with_an_error_and_done(server, model_name, health):
    async def read(client):
        async with client.stream(
            "POST", f"{server}/v1/chat/completions", json=chat_body(model_name, "Write a long essay.", 2000)
        ) as r:
            return read_events(_Lines([line async for line in r.aiter_lines()]))

    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(read(client)) for _ in range(3)]
        deadline = time.monotonic() + 30
        while (await asyncio.to_thread(health))["num_running"] < 3:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert (await client.post(f"{server}/debug/fault")).status_code == 200
        for events in await asyncio.gather(*tasks):
            assert events[-1].data == "[DONE]"
            error = events[-2].json()["error"]
            assert "injected fault" in error["message"] and error["type"] == "server_error"
        # Every block still in use is pinned by a stored response of an earlier test on this shared server.
        after = health()
        assert after == {**after, "status": "ok", "kv_blocks_used": after["kv_blocks_pinned"], "num_running": 0}
        text, reason = await _stream_chat(client, server, chat_body(model_name, "Hi", 4))
        assert reason == "length" and text
