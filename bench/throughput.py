"""Streaming throughput of an OpenAI-compatible server at a few concurrency levels.

    python bench/throughput.py                          # against a running server on :8000
    python bench/throughput.py --spawn "--dtype float32" --spawn "--dtype bfloat16"

With --spawn, starts a Sluice server per flag set (one after another, same run) so
the figures compare like with like. Tokens are counted from `usage` (include_usage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import time

import httpx

from app import server_process

PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain in detail how a steam engine works.",
    "Describe a journey across a desert, step by step.",
    "Write a detailed recipe for bread, with every step.",
]


async def one_stream(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if ttft is None and payload["choices"] and payload["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
    return ttft or float("nan"), tokens


async def level(base: str, concurrency: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *[one_stream(client, base, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(concurrency)]
        )
        elapsed = time.perf_counter() - start
    tokens = sum(t for _, t in results)
    return {
        "concurrency": concurrency,
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "ttft_p50_s": round(statistics.median(t for t, _ in results), 3),
        "completion_tokens": tokens,
        "elapsed_s": round(elapsed, 2),
    }


async def run_levels(base: str, levels: list[int], max_tokens: int) -> list[dict]:
    await level(base, 1, 4)  # warm-up
    return [await level(base, c, max_tokens) for c in levels]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--spawn", action="append", help="start a server with these flags (repeatable)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    targets = args.spawn or [None]
    for flags in targets:
        proc = None
        if flags is None:
            base, label = args.base_url, args.base_url
        else:
            started = time.perf_counter()
            proc, base = server_process.start(shlex.split(flags))
            startup = time.perf_counter() - started
            label = f"sluice {flags}".strip()
            print(f"[{label}] start-up {startup:.1f} s")
        try:
            for row in asyncio.run(run_levels(base, args.concurrency, args.max_tokens)):
                print(f"[{label}] " + json.dumps(row))
        finally:
            if proc is not None:
                server_process.stop(proc)


if __name__ == "__main__":
    main()
