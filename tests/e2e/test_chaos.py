"""Chaos: a few hundred mixed requests at 32 concurrent connections against one default server.

Normal and slow streams, clients that vanish mid-stream, DELETE cancels, malformed bodies and
non-streamed requests, interleaved: nothing hangs, every malformed body gets a 4xx with an
error object, every normal answer equals the same request served alone, and afterwards the
server holds no request and no KV block more than before.
"""

import asyncio
import json
import time

import httpx
import pytest

from app.sse_reader import parse_events, stream_text
from tests.e2e.conftest import blocks_held

pytestmark = pytest.mark.slow

PROMPTS = [f"Tell me one fact about {topic}." for topic in ("cats", "rain", "bread", "ships", "bees", "chess", "ice")]
MALFORMED = [
    b"{not json",
    json.dumps({"messages": "hello"}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).encode(),
    json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 9}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 0}).encode(),
]


def body(prompt: str, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0, "stream": stream}


async def read_stream(response: httpx.Response, delay: float = 0.0) -> list:
    lines = []
    async for line in response.aiter_lines():
        lines.append(line)
        if delay:
            await asyncio.sleep(delay)
    return parse_events(lines)


async def test_mixed_traffic_leaves_the_server_as_it_found_it(server):
    base = server
    url = f"{base}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=120) as client:
        before = (await client.get(f"{base}/health")).json()
        alone = {}
        for prompt in PROMPTS:
            async with client.stream("POST", url, json=body(prompt, True)) as response:
                alone[prompt] = stream_text(await read_stream(response))
        gate = asyncio.Semaphore(32)
        outcomes: list[str] = []

        async def one(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            kind = i % 6
            async with gate:
                if kind == 4:
                    response = await client.post(url, content=MALFORMED[i % len(MALFORMED)])
                    assert 400 <= response.status_code < 500, response.text
                    assert response.json()["error"]["message"]
                elif kind == 5:
                    response = await client.post(url, json=body(prompt, False))
                    choice = response.json()["choices"][0]
                    assert (choice["message"]["content"], choice["finish_reason"]) == alone[prompt]
                elif kind == 1:
                    # A client that vanishes after two events.
                    async with client.stream("POST", url, json=body(prompt, True)) as response:
                        seen = 0
                        async for line in response.aiter_lines():
                            seen += line.startswith("data:")
                            if seen == 2:
                                break
                elif kind == 3:
                    # Cancelled by id from "another client" once its first event is in (it may
                    # also have finished by then: DELETE answers 404 and the stream ends normally).
                    async with client.stream("POST", url, json=body(prompt, True)) as response:
                        lines = response.aiter_lines()
                        async for line in lines:
                            if line.startswith("data:"):
                                completion_id = json.loads(line[5:])["id"]
                                break
                        deleted = await client.delete(f"{base}/v1/streams/{completion_id}")
                        assert deleted.status_code in (200, 404)
                        events = parse_events([line async for line in lines])
                    assert events[-1].data == "[DONE]"
                    last = events[-2].json()
                    assert "error" not in last or last["error"]["code"] == "cancelled"
                else:
                    async with client.stream("POST", url, json=body(prompt, True)) as response:
                        events = await read_stream(response, delay=0.05 if kind == 2 else 0.0)
                    assert events[-1].data == "[DONE]"
                    assert stream_text(events) == alone[prompt]
            outcomes.append("ok")

        await asyncio.wait_for(asyncio.gather(*[one(i) for i in range(240)]), timeout=600)
        assert len(outcomes) == 240

        deadline = time.monotonic() + 30
        while True:
            after = (await client.get(f"{base}/health")).json()
            settled = after["num_running"] == 0 and after["num_waiting"] == 0
            if settled and blocks_held(after) == blocks_held(before):
                break
            assert time.monotonic() < deadline, f"server did not settle: {after}"
            await asyncio.sleep(0.2)
