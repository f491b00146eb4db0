"""The event loop's CPU per request: bursts of short streamed requests against a Sluice server.

    python bench/request_cost.py                  # 5 bursts of 64 requests of 4 tokens
    python bench/request_cost.py --burst 256 --max-tokens 1

With so few tokens per request, what the server's event loop (its main thread) spends is mostly a
request's start-up: validation, chat template and tokenizer, dependencies, the SSE response's tasks,
and its end. The model is bench/hostcost.py's tiny random Llama, so the engine costs little.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import hostcost, serve  # noqa: E402


async def bursts(base: str, pid: int, args: argparse.Namespace) -> list[float]:
    """Milliseconds of the loop's CPU per request, one figure per burst (after one to warm up)."""
    workload = SimpleNamespace(max_tokens=args.max_tokens, temperature=0.0, top_p=1.0)
    await hostcost.http_level(base, None, args.burst, workload)
    figures = []
    for _ in range(args.bursts):
        before = hostcost.loop_cpu_seconds(pid)
        await hostcost.http_level(base, None, args.burst, workload)
        figures.append(1000 * (hostcost.loop_cpu_seconds(pid) - before) / args.burst)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=64, help="concurrent requests per burst")
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--cache-dir", type=Path, default=hostcost.DEFAULT_CACHE)
    args = parser.parse_args()
    folder = hostcost.tiny_model_folder(args.cache_dir)
    proc, base = serve.spawn(f"--model {folder} --max-num-seqs {args.burst} --max-num-batched-tokens 4096")
    try:
        figures = asyncio.run(bursts(base, proc.pid, args))
    finally:
        proc.terminate()
        proc.wait()
    print(f"`python {' '.join(sys.argv)}`")
    print(f"event-loop CPU per request: median {statistics.median(figures):.2f} ms; bursts {sorted(figures)}")


if __name__ == "__main__":
    main()
