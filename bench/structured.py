"""What structured output costs, and what jump-forward gains, measured in one run.

    python bench/structured.py                      # spawns the servers it needs, default settings
    python bench/structured.py --flags "--dtype float32" --concurrency 8 32

Workload: chat requests asking for a list of employee records as JSON, constrained by
a schema with many fixed keys (enums, integers, booleans, bounded strings), so most
of the output is structure. At each concurrency level, that many workers send
non-streamed requests back to back. Three runs per level:

* constrained, on a default server (jump-forward on);
* unconstrained: the same prompts, no schema, `ignore_eos` and max_tokens set to the
  constrained run's mean output, so both produce the same number of tokens;
* constrained on a second server started with --no-jump-forward.

Output tokens are counted from `usage`. Prints tokens/s and requests/s per run and
the ratios constrained / unconstrained and jump-forward on / off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve import spawn  # noqa: E402

RECORD = {
    "type": "object",
    "properties": {
        "first_name": {"type": "string", "maxLength": 12},
        "last_name": {"type": "string", "maxLength": 12},
        "department": {"enum": ["engineering", "sales", "marketing", "support"]},
        "employee_id": {"type": "integer", "minimum": 1000, "maximum": 9999},
        "is_manager": {"type": "boolean"},
        "office": {"enum": ["London", "Paris", "Berlin", "Madrid"]},
    },
    "required": ["first_name", "last_name", "department", "employee_id", "is_manager", "office"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 3, "maxItems": 3}},
    "required": ["records"],
    "additionalProperties": False,
}
TEAMS = ["a bakery", "a bank", "a school", "a hospital", "a shipyard", "a newspaper", "a theatre", "a farm"]


def body(index: int, constrained: bool, max_tokens: int) -> dict:
    request = {
        "messages": [{"role": "user", "content": f"List three employees of {TEAMS[index % len(TEAMS)]} as JSON."}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": index,
    }
    if constrained:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "staff", "schema": SCHEMA}}
    else:
        request["ignore_eos"] = True
    return request


async def run(base: str, concurrency: int, per_worker: int, constrained: bool, max_tokens: int) -> dict:
    tokens: list[int] = []
    valid = 0

    async def worker(worker_index: int, client: httpx.AsyncClient) -> None:
        nonlocal valid
        for i in range(per_worker):
            response = await client.post(
                f"{base}/v1/chat/completions", json=body(worker_index * per_worker + i, constrained, max_tokens)
            )
            response.raise_for_status()
            reply = response.json()
            tokens.append(reply["usage"]["completion_tokens"])
            if constrained and reply["choices"][0]["finish_reason"] == "stop":
                json.loads(reply["choices"][0]["message"]["content"])
                valid += 1

    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        await asyncio.gather(*[worker(w, client) for w in range(concurrency)])
        elapsed = time.perf_counter() - start
    return {
        "tokens_per_s": round(sum(tokens) / elapsed, 2),
        "requests_per_s": round(len(tokens) / elapsed, 3),
        "mean_tokens": round(sum(tokens) / len(tokens), 1),
        "valid_json": valid if constrained else None,
        "requests": len(tokens),
    }


async def warm_up(base: str) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        for constrained in (True, False):
            (await client.post(f"{base}/v1/chat/completions", json=body(0, constrained, 32))).raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", default="", help="server flags for both servers")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--requests-per-worker", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=400, help="cap on a constrained reply")
    parser.add_argument("--out", type=Path, default=Path("bench/results/structured.json"))
    args = parser.parse_args()

    results: dict[int, dict] = {}
    proc, base = spawn(args.flags)
    try:
        asyncio.run(warm_up(base))
        for concurrency in args.concurrency:
            constrained = asyncio.run(run(base, concurrency, args.requests_per_worker, True, args.max_tokens))
            free = asyncio.run(
                run(base, concurrency, args.requests_per_worker, False, round(constrained["mean_tokens"]))
            )
            results[concurrency] = {"constrained": constrained, "unconstrained": free}
    finally:
        proc.terminate()
        proc.wait()
    proc, base = spawn(f"{args.flags} --no-jump-forward")
    try:
        asyncio.run(warm_up(base))
        for concurrency in args.concurrency:
            results[concurrency]["no_jump_forward"] = asyncio.run(
                run(base, concurrency, args.requests_per_worker, True, args.max_tokens)
            )
    finally:
        proc.terminate()
        proc.wait()

    for concurrency, runs in results.items():
        runs["constrained_over_unconstrained"] = round(
            runs["constrained"]["tokens_per_s"] / runs["unconstrained"]["tokens_per_s"], 3
        )
        runs["jump_forward_speedup_requests"] = round(
            runs["constrained"]["requests_per_s"] / runs["no_jump_forward"]["requests_per_s"], 3
        )
        print(f"concurrency {concurrency}: {json.dumps(runs)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"flags": args.flags, "results": results}, indent=2))


if __name__ == "__main__":
    main()
