"""Speculative decoding on and off, measured in one run on one server.

    python bench/speculative.py --base-url http://127.0.0.1:8000     # a server started with --speculative ngram
    python bench/speculative.py --spawn "--speculative ngram"

The server speculates; the baseline is the same server with the per-request
extension `"speculative": false`, so both sides share the process, the weights and
the machine's noise, and requests alternate between them. Prints:

* single-stream decode speed (from each response's `timings`: tokens after the first
  divided by the time after the first) on an extractive workload (the answer quotes
  a passage from the prompt) and on open-ended chat, with the acceptance rate;
* aggregate output tokens/s at 8 and 32 concurrent chat streams, on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve import spawn  # noqa: E402

PASSAGES = [
    "The lighthouse stood on a rock at the mouth of the bay. Every evening at dusk the keeper climbed "
    "the one hundred and twelve steps of the spiral stair, trimmed the wick, polished the great lens "
    "and lit the lamp. Ships passing in the night saw its beam sweep across the water every ten seconds, "
    "and they knew where the rocks were.",
    "Bread needs only four things: flour, water, salt and yeast. Mix them into a rough dough, knead it "
    "for ten minutes until it is smooth and elastic, and leave it covered in a warm place until it has "
    "doubled in size. Shape it into a loaf, let it rise again, and bake it in a hot oven for about forty "
    "minutes, until it sounds hollow when tapped underneath.",
    "A steam engine burns fuel to boil water in a closed boiler. The steam, under pressure, is let into a "
    "cylinder where it pushes a piston. A valve then lets the used steam out and lets fresh steam in on "
    "the other side, so the piston moves back and forth, and a crank turns that motion into the rotation "
    "of a wheel.",
]
EXTRACTIVE = [f"{passage}\n\nCopy the text above word for word." for passage in PASSAGES]
CHAT = [
    "Write a story about a dragon who learns to cook.",
    "Give me some ideas for a rainy weekend.",
    "Why do cats purr? Answer briefly.",
]


async def completion(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, speculative: bool) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "speculative": speculative,
    }
    response = await client.post(f"{base}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()


async def single_stream(base: str, prompts: list[str], max_tokens: int, rounds: int) -> dict:
    """Decode tokens/s with and without speculation, alternating request by request."""
    speed = {True: [], False: []}
    drafted = accepted = 0
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(rounds):
            for prompt in prompts:
                for speculative in (True, False):
                    timings = (await completion(client, base, prompt, max_tokens, speculative))["timings"]
                    speed[speculative].append(timings["predicted_per_second"])
                    if speculative:
                        drafted += timings["draft_n"]
                        accepted += timings["draft_n_accepted"]
    on, off = statistics.median(speed[True]), statistics.median(speed[False])
    return {
        "on_tok_s": round(on, 1),
        "off_tok_s": round(off, 1),
        "speedup": round(on / off, 2),
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "proposed_per_request": round(drafted / len(speed[True]), 1),
    }


async def aggregate(base: str, concurrency: int, max_tokens: int, speculative: bool) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *[
                completion(client, base, CHAT[i % len(CHAT)] + f" ({i})", max_tokens, speculative)
                for i in range(concurrency)
            ]
        )
        elapsed = time.perf_counter() - start
    return sum(r["usage"]["completion_tokens"] for r in results) / elapsed


async def run(base: str, args: argparse.Namespace) -> dict:
    report = {
        "extractive": await single_stream(base, EXTRACTIVE, args.max_tokens, args.rounds),
        "chat": await single_stream(base, CHAT, args.max_tokens, args.rounds),
    }
    for concurrency in args.concurrency:
        on = await aggregate(base, concurrency, args.max_tokens, True)
        off = await aggregate(base, concurrency, args.max_tokens, False)
        report[f"{concurrency}_streams"] = {
            "on_tok_s": round(on, 1),
            "off_tok_s": round(off, 1),
            "ratio": round(on / off, 2),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server started with --speculative")
    parser.add_argument("--spawn", help="start a Sluice server with these flags instead")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[8, 32])
    args = parser.parse_args()
    proc = None
    base = args.base_url or "http://127.0.0.1:8000"
    if args.spawn:
        proc, base = spawn(args.spawn)
    try:
        print(json.dumps(asyncio.run(run(base, args)), indent=2))
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
