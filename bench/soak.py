"""Soak: minutes of mixed traffic using every feature against one server, checking what its streams promise.

    python bench/soak.py                                       # a default server of its own: 5 minutes, 32 clients
    python bench/soak.py --server http://127.0.0.1:8000 --duration 600
    python bench/soak.py --flags "--model TINY --max-num-seqs 256 --speculative ngram" --concurrency 200

Each client sends random requests back to back: chat (streamed or not; n, stop strings, logprobs,
penalties, logit bias, greedy or seeded with top-p / top-k / min-p, a JSON schema, tools, a chunk
interval), text completions, Responses (stored, continued with previous_response_id, deleted) and
malformed bodies. Some streamed readers vanish after a few events, read slowly, cancel their stream
with DELETE from another connection, or drop a resumable stream and resume it after the last event
they read. It checks:

* every stream ends with [DONE] (a Responses stream with response.completed or .incomplete), its
  event ids run 1, 2, 3... with no gap or repeat (resumed ones included), every choice has exactly
  one finish chunk, and no error event comes unasked;
* a malformed body gets a 4xx with an OpenAI error object;
* a greedy or seeded body gives the same text every time, whatever else runs (the default
  batch-invariant mode promises it);
* no request takes longer than `--timeout`;
* afterwards the server settles: nothing running or waiting, and the KV blocks in use back to what
  they were less what stored responses pin.

The client is httpx with its default pool, as the OpenAI SDK uses it. It prints each failure as it
happens and the counts at the end, and exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.sse_reader import Event, parse_events  # noqa: E402
from bench import serve  # noqa: E402

PROMPTS = [f"Tell me one fact about {topic}." for topic in ("cats", "rain", "bread", "ships", "bees", "chess", "maps")]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CHAT_MESSAGE = [{"role": "user", "content": "hi"}]
MALFORMED = [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": CHAT_MESSAGE, "max_tokens": -1}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": CHAT_MESSAGE, "n": 0}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": CHAT_MESSAGE, "logit_bias": {"999999": 5}}).encode()),
    (
        "/v1/chat/completions",
        json.dumps(
            {"messages": CHAT_MESSAGE, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}
        ).encode(),
    ),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x " * 9000}]}).encode()),
    ("/v1/completions", json.dumps({"prompt": [99999999]}).encode()),
]


@dataclass
class Soak:
    base: str
    rng: random.Random
    timeout: float
    counts: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    # Every text a deterministic body gave: more than one is a failure.
    texts: dict[str, set] = field(default_factory=lambda: collections.defaultdict(set))

    def fail(self, what: str, context: object) -> None:
        line = f"{what}: {json.dumps(context)[:800]}"
        self.failures.append(line)
        print("FAIL", line, flush=True)

    async def client(self, http: httpx.AsyncClient, deadline: float) -> None:
        kinds = [(self.chat, 70), (self.completion, 10), (self.response, 12), (self.malformed, 8)]
        while time.monotonic() < deadline:
            kind = self.rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
            try:
                await asyncio.wait_for(kind(http), self.timeout)
            except TimeoutError:
                self.fail(f"{kind.__name__} took over {self.timeout} s", {})
            except Exception as error:  # noqa: BLE001 - any client-side failure is a finding to report
                self.fail(f"{kind.__name__} raised {type(error).__name__}: {error}", {})

    # Requests.

    def chat_body(self) -> dict:
        rng = self.rng
        body: dict = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
        body["max_tokens"] = rng.choice([1, 2, 5, 12, 30, 64])
        if rng.random() < 0.4:
            body["temperature"] = 0
        else:
            body.update(temperature=rng.choice([0.3, 0.7, 1.0, 1.5]), seed=rng.randrange(5))
            if rng.random() < 0.5:
                body["top_p"] = rng.choice([0.5, 0.9, 0.99])
            if rng.random() < 0.3:
                body["top_k"] = rng.choice([1, 5, 40])
            if rng.random() < 0.2:
                body["min_p"] = rng.choice([0.05, 0.2])
        optional = [
            (0.3, {"n": rng.choice([2, 3])}),
            (0.2, {"stop": rng.choice([".", [" the", ","], "\n"])}),
            (0.15, {"logprobs": True, "top_logprobs": rng.choice([0, 3])}),
            (0.1, {"presence_penalty": 0.5, "frequency_penalty": 0.3}),
            (0.1, {"logit_bias": {"13": -100}}),
            (0.15, {"stream_interval": rng.choice([2, 5])}),
            (0.1, {"speculative": False}),
            (0.2, {"stream_options": {"include_usage": True}}),
        ]
        for chance, extra in optional:
            if rng.random() < chance:
                body.update(extra)
        constraint = rng.random()
        if constraint < 0.08:
            schema = {"name": "person", "schema": PERSON}
            body.update(response_format={"type": "json_schema", "json_schema": schema}, max_tokens=60)
        elif constraint < 0.14:
            body.update(tools=TOOLS, tool_choice=rng.choice(["auto", "required"]), max_tokens=60)
        return body

    async def chat(self, http: httpx.AsyncClient) -> None:
        body = self.chat_body()
        url = f"{self.base}/v1/chat/completions"
        if self.rng.random() < 0.2:
            response = await http.post(url, json={**body, "stream": False})
            if response.status_code != 200 or len(response.json()["choices"]) != body.get("n", 1):
                return self.fail(f"chat answered {response.status_code}", {"body": body, "text": response.text[:300]})
            self.counts["chat, not streamed"] += 1
            return
        body["stream"] = True
        way = self.rng.random()
        if way < 0.12:
            await self.vanish(http, url, body)
        elif way < 0.18:
            await self.resume(http, url, body)
        elif way < 0.24:
            await self.cancel(http, url, body)
        else:
            await self.read(http, url, body, slow=way > 0.95)

    async def read(self, http: httpx.AsyncClient, url: str, body: dict, slow: bool) -> None:
        lines = []
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return self.fail(f"chat stream answered {response.status_code}", {"body": body})
            async for line in response.aiter_lines():
                lines.append(line)
                if slow:
                    await asyncio.sleep(0.03)
        self.check_chat_stream(body, parse_events(lines))
        self.counts["chat, slow reader" if slow else "chat, streamed"] += 1

    async def vanish(self, http: httpx.AsyncClient, url: str, body: dict) -> None:
        after = self.rng.randrange(1, 6)
        async with http.stream("POST", url, json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen >= after:
                    break
        self.counts["chat, reader vanished"] += 1

    async def resume(self, http: httpx.AsyncClient, url: str, body: dict) -> None:
        """Read a few events of a resumable stream, drop the connection, and resume after the last
        whole event read (events the server wrote after it may be lost with the connection)."""
        body["resumable"] = True
        lines: list[str] = []
        async with http.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                lines.append(line)
                if len(lines) > 8:
                    break
        while lines and lines[-1] != "":
            lines.pop()
        first = parse_events(lines)
        if not first:
            return self.fail("a resumable stream sent no whole event", {"body": body})
        await asyncio.sleep(self.rng.random() * 0.5)
        completion_id = first[0].json()["id"]
        headers = {"Last-Event-ID": first[-1].id}
        async with http.stream("GET", f"{self.base}/v1/streams/{completion_id}", headers=headers) as response:
            if response.status_code != 200:
                return self.fail(f"resume answered {response.status_code}", {"body": body})
            lines += [line async for line in response.aiter_lines()]
        self.check_chat_stream(body, parse_events(lines))
        self.counts["chat, resumed"] += 1

    async def cancel(self, http: httpx.AsyncClient, url: str, body: dict) -> None:
        lines = []
        async with http.stream("POST", url, json=body) as response:
            events = response.aiter_lines()
            async for line in events:
                lines.append(line)
                if line.startswith("data:"):
                    completion_id = json.loads(line[5:])["id"]
                    break
            deleted = await http.delete(f"{self.base}/v1/streams/{completion_id}")
            if deleted.status_code not in (200, 404):
                self.fail(f"DELETE answered {deleted.status_code}", {"body": body})
            lines += [line async for line in events]
        data = [event.data for event in parse_events(lines)]
        if data[-1:] != ["[DONE]"]:
            return self.fail("a cancelled stream did not end with [DONE]", {"body": body})
        self.counts["chat, cancelled"] += 1

    async def completion(self, http: httpx.AsyncClient) -> None:
        rng = self.rng
        body = {"prompt": rng.choice([rng.choice(PROMPTS), [1, 2, 3, 4, 5]]), "max_tokens": rng.choice([1, 8, 20])}
        body.update(temperature=0, stream=rng.random() < 0.7)
        if rng.random() < 0.3:
            body["logprobs"] = 2
        url = f"{self.base}/v1/completions"
        if not body["stream"]:
            response = await http.post(url, json=body)
            if response.status_code != 200:
                return self.fail(f"completion answered {response.status_code}", {"body": body})
        else:
            async with http.stream("POST", url, json=body) as response:
                events = parse_events([line async for line in response.aiter_lines()])
            if not events or events[-1].data != "[DONE]":
                return self.fail("a completion stream did not end with [DONE]", {"body": body})
        self.counts["completion"] += 1

    async def response(self, http: httpx.AsyncClient) -> None:
        rng = self.rng
        body = {"input": rng.choice(PROMPTS), "max_output_tokens": rng.choice([5, 20, 40]), "temperature": 0}
        body.update(stream=rng.random() < 0.7, store=rng.random() < 0.5)
        url = f"{self.base}/v1/responses"
        if body["stream"]:
            async with http.stream("POST", url, json=body) as response:
                events = parse_events([line async for line in response.aiter_lines()])
            last = events[-1].json() if events else {}
            if last.get("type") not in ("response.completed", "response.incomplete"):
                return self.fail("a Responses stream did not end completed or incomplete", {"last": last})
            response_id = last["response"]["id"]
        else:
            response = await http.post(url, json=body)
            if response.status_code != 200:
                return self.fail(f"a response answered {response.status_code}", {"body": body})
            response_id = response.json()["id"]
        if body["store"] and rng.random() < 0.5:
            follow_up = {"input": "And another?", "previous_response_id": response_id, "max_output_tokens": 10}
            response = await http.post(url, json=follow_up)
            if response.status_code != 200:
                return self.fail(f"a follow-up answered {response.status_code}", {"text": response.text[:300]})
            if rng.random() < 0.5:
                await http.delete(f"{url}/{response_id}")
        self.counts["response"] += 1

    async def malformed(self, http: httpx.AsyncClient) -> None:
        path, payload = self.rng.choice(MALFORMED)
        response = await http.post(f"{self.base}{path}", content=payload, headers={"Content-Type": "application/json"})
        if not 400 <= response.status_code < 500 or "error" not in response.json():
            return self.fail(f"a malformed body got {response.status_code}", {"body": payload[:100].decode()})
        self.counts["malformed"] += 1

    # Checks.

    def check_chat_stream(self, body: dict, events: list[Event]) -> None:
        ids = [int(event.id) for event in events if event.id is not None]
        if ids != list(range(1, len(ids) + 1)):
            return self.fail("event ids are not 1, 2, 3...", {"body": body, "ids": ids})
        data = [event.data for event in events]
        if data[-1:] != ["[DONE]"]:
            return self.fail("a stream did not end with [DONE]", {"body": body})
        finishes: collections.Counter = collections.Counter()
        texts: dict[int, str] = collections.defaultdict(str)
        for payload in data[:-1]:
            chunk = json.loads(payload)
            if "error" in chunk:
                return self.fail("an error event", {"body": body, "error": chunk["error"]})
            for choice in chunk.get("choices", []):
                finishes[choice["index"]] += bool(choice.get("finish_reason"))
                delta = choice.get("delta", {})
                texts[choice["index"]] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    function = call.get("function", {})
                    texts[choice["index"]] += (f"[{function['name']}]" if function.get("name") else "") + (
                        function.get("arguments") or ""
                    )
        choices = range(body.get("n", 1))
        if any(finishes[i] != 1 for i in choices):
            return self.fail("a choice without exactly one finish chunk", {"body": body, "finishes": finishes})
        if body.get("temperature") == 0 or "seed" in body:
            unchunked = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "stream_interval")}
            seen = self.texts[json.dumps(unchunked, sort_keys=True)]
            seen.add(tuple(texts[i] for i in choices))
            if len(seen) > 1:
                self.fail("the same greedy or seeded body gave different texts", {"body": body, "texts": list(seen)})

    async def settled(self, http: httpx.AsyncClient, before: dict) -> dict:
        """/health once nothing runs and the KV in use is back to `before` (less pinned blocks)."""
        deadline = time.monotonic() + 60
        while True:
            after = (await http.get(f"{self.base}/health")).json()
            pinned = after["kv_blocks_pinned"] - before["kv_blocks_pinned"]
            idle = after["num_running"] == 0 and after["num_waiting"] == 0
            if idle and after["kv_blocks_used"] == before["kv_blocks_used"] + pinned:
                return after
            if time.monotonic() > deadline:
                self.fail("the server did not settle in 60 s", {"before": before, "after": after})
                return after
            await asyncio.sleep(0.5)


async def run(soak: Soak, duration: float, concurrency: int) -> None:
    async with httpx.AsyncClient(timeout=soak.timeout, limits=httpx.Limits(max_connections=2 * concurrency)) as http:
        before = (await http.get(f"{soak.base}/health")).json()
        deadline = time.monotonic() + duration
        await asyncio.gather(*(soak.client(http, deadline) for _ in range(concurrency)))
        after = await soak.settled(http, before)
    print(f"health before: {before}\nhealth after:  {after}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="a running server's base URL; otherwise one is started with --flags")
    parser.add_argument("--flags", default="", help="flags of the server this starts")
    parser.add_argument("--duration", type=float, default=300, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=32, help="clients sending requests back to back")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a request may take")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    proc = None
    base = args.server
    if base is None:
        proc, base = serve.spawn(args.flags)
    soak = Soak(base.rstrip("/"), random.Random(args.seed), args.timeout)
    try:
        asyncio.run(run(soak, args.duration, args.concurrency))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    print(f"`python {shlex.join(sys.argv)}`")
    print("requests: " + ", ".join(f"{kind} {count}" for kind, count in sorted(soak.counts.items())))
    print(f"failures: {len(soak.failures)}")
    sys.exit(1 if soak.failures else 0)


if __name__ == "__main__":
    main()
