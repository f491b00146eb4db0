"""The event loop's CPU per request: bursts of short streamed requests against a Sluice server.

    python bench/request_cost.py                  # 5 bursts of 64 requests of 4 tokens
    python bench/request_cost.py --burst 256 --max-tokens 1
    python bench/request_cost.py --before /tmp/before --bursts 12   # against a server from another worktree

With so few tokens per request, what the server's event loop (its main thread) spends is mostly a
request's start-up: validation, chat template and tokenizer, dependencies, the SSE response's tasks,
and its end. The model is bench/hostcost.py's tiny random Llama, so the engine costs little.
With `--before`, a second server runs from that checkout (say `git worktree add /tmp/before COMMIT`)
and the two take bursts in turn, so both see the same machine.
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


async def bursts(servers: dict[str, tuple[str, int]], args: argparse.Namespace) -> dict[str, list[float]]:
    """Milliseconds of each server's loop CPU per request, one figure per burst (after one to warm up),
    the servers taking bursts in turn."""
    workload = SimpleNamespace(max_tokens=args.max_tokens, temperature=0.0, top_p=1.0)
    figures: dict[str, list[float]] = {name: [] for name in servers}
    for base, _ in servers.values():
        await hostcost.http_level(base, None, args.burst, workload)
    for _ in range(args.bursts):
        for name, (base, pid) in servers.items():
            before = hostcost.loop_cpu_seconds(pid)
            await hostcost.http_level(base, None, args.burst, workload)
            figures[name].append(1000 * (hostcost.loop_cpu_seconds(pid) - before) / args.burst)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--burst", type=int, default=64, help="concurrent requests per burst")
    parser.add_argument("--bursts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--cache-dir", type=Path, default=hostcost.DEFAULT_CACHE)
    parser.add_argument(
        "--before", type=Path, help="another checkout, whose server takes bursts in turn with this one's"
    )
    args = parser.parse_args()
    folder = hostcost.tiny_model_folder(args.cache_dir)
    flags = f"--model {folder} --max-num-seqs {args.burst} --max-num-batched-tokens 4096"
    procs = {}
    try:
        if args.before is not None:
            procs["before"] = serve.spawn(flags, checkout=args.before)
        procs["this checkout"] = serve.spawn(flags)
        figures = asyncio.run(bursts({name: (base, proc.pid) for name, (proc, base) in procs.items()}, args))
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait()
    print(f"`python {' '.join(sys.argv)}`")
    for name, values in figures.items():
        print(
            f"{name}: event-loop CPU per request: median {statistics.median(values):.2f} ms, "
            f"mean {statistics.mean(values):.2f} ms; bursts {sorted(round(v, 2) for v in values)}"
        )


if __name__ == "__main__":
    main()
