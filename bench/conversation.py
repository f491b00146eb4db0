"""Time to first token along a growing conversation: stored responses against resent history.

    python bench/conversation.py                   # spawns the servers it needs, default settings
    python bench/conversation.py --turns 10 --flags "--dtype float32"

Three ways to hold the same 10-turn conversation (greedy, 64 output tokens a turn, a
long first message so the history is worth keeping):

* `responses`: /v1/responses with `previous_response_id`: the server keeps the
  conversation's token ids and pins its KV, so a turn prefills only its new input;
* `chat+cache`: /v1/chat/completions resending the whole history each turn, prefix
  caching on (the default): the history's full blocks come from the cache while they last;
* `chat-nocache`: the same on a server started with --no-enable-prefix-caching.

TTFT is measured at the client, from sending to the first text delta. Prints each
turn's TTFT, input tokens and cached tokens, and the last turn side by side.

With `--churn N`, N other requests with long distinct prompts run between turns, as other
users' traffic would, and push unpinned blocks out of the prefix cache (give the servers a
small `--kv-cache-gib` in `--flags` so that they must).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve import spawn  # noqa: E402
from bench.speculative import PASSAGES  # noqa: E402

QUESTIONS = [
    "Summarize it in one sentence.",
    "What is the most important detail?",
    "Who would enjoy reading this?",
    "Give it a title.",
    "What happens next?",
    "Rewrite the first sentence more simply.",
    "Name one thing that could go wrong.",
    "What would a child ask about it?",
    "Describe the mood.",
    "Say goodbye.",
]


def user_message(turn: int) -> str:
    if turn == 0:
        return "Here is a text:\n\n" + "\n\n".join(PASSAGES) + "\n\nWhat is it about?"
    return QUESTIONS[(turn - 1) % len(QUESTIONS)]


def row(ttft: float, input_tokens: int, cached_tokens: int) -> dict:
    return {"ttft_ms": round(ttft * 1000, 1), "input_tokens": input_tokens, "cached_tokens": cached_tokens}


def stream_turn(client: httpx.Client, url: str, body: dict, delta_of) -> tuple[float, str, dict]:
    """(TTFT in s, the reply's text, the last event) of one streamed request."""
    start = time.perf_counter()
    ttft, text, last = None, [], {}
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            piece = delta_of(event)
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            text.append(piece or "")
            last = event
    return ttft or time.perf_counter() - start, "".join(text), last


def churn(client: httpx.Client, base: str, turn: int, count: int) -> None:
    """Other users' requests: long prompts seen once, one token each."""
    for i in range(count):
        filler = " ".join(f"word{turn}x{i}x{j}" for j in range(150))
        body = {"messages": [{"role": "user", "content": filler}], "max_tokens": 1}
        client.post(f"{base}/v1/chat/completions", json=body).raise_for_status()


def responses_conversation(base: str, turns: int, max_tokens: int, churns: int) -> list[dict]:
    rows, previous = [], None
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            churn(client, base, turn, churns)
            body = {
                "input": user_message(turn),
                "max_output_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "previous_response_id": previous,
            }
            ttft, _, last = stream_turn(
                client,
                f"{base}/v1/responses",
                body,
                lambda e: e.get("delta") if e.get("type") == "response.output_text.delta" else None,
            )
            response = last["response"]
            previous = response["id"]
            usage = response["usage"]
            rows.append(row(ttft, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]))
    return rows


def chat_conversation(base: str, turns: int, max_tokens: int, churns: int) -> list[dict]:
    rows, messages = [], []
    with httpx.Client(timeout=600) as client:
        for turn in range(turns):
            churn(client, base, turn, churns)
            messages.append({"role": "user", "content": user_message(turn)})
            body = {
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            ttft, text, last = stream_turn(
                client,
                f"{base}/v1/chat/completions",
                body,
                lambda e: e["choices"][0]["delta"].get("content") if e.get("choices") else None,
            )
            messages.append({"role": "assistant", "content": text})
            usage = last["usage"]
            rows.append(row(ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", default="", help="server flags for every server")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--churn", type=int, default=0, help="other requests between turns")
    parser.add_argument("--out", type=Path, default=Path("bench/results/conversation.json"))
    args = parser.parse_args()

    results = {}
    # A fresh server each: the chat runs must not find the blocks the responses run pinned.
    for mode, flags, converse in (
        ("responses", args.flags, responses_conversation),
        ("chat+cache", args.flags, chat_conversation),
        ("chat-nocache", f"{args.flags} --no-enable-prefix-caching", chat_conversation),
    ):
        proc, base = spawn(flags)
        try:
            results[mode] = converse(base, args.turns, args.max_tokens, args.churn)
        finally:
            proc.terminate()
            proc.wait()

    for mode, rows in results.items():
        print(f"{mode:>13}: TTFT ms per turn {[r['ttft_ms'] for r in rows]}")
        cached = [r["cached_tokens"] for r in rows]
        print(f"{'':>13}  input tokens {[r['input_tokens'] for r in rows]}, cached {cached}")
    last = {mode: rows[-1] for mode, rows in results.items()}
    print(f"turn {args.turns}: " + ", ".join(f"{mode} {row['ttft_ms']} ms" for mode, row in last.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"flags": args.flags, "churn": args.churn, "results": results}, indent=2))


if __name__ == "__main__":
    main()
