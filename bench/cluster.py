"""`sluice cluster` on bench/stub_accelerator.py's stand-in step: replicas scale as on separate accelerators.

    python bench/cluster.py                                  # 1, 2, 4 replicas, 20 ms steps, 8 streams per replica
    python bench/cluster.py --replicas 1 2 --step-ms 10 --per-replica 16

Every engine replica's forward is the stub (a fixed step time with the GIL released), so what one replica
makes is bounded by its step, as on a GPU, and what N make together by the ingress, the router and the host.
The model is bench/hostcost.py's random-weight Llama with the default model's tokenizer. Reports:

- scaling: output tokens/s at each number of replicas with `--per-replica` streams per replica (one ingress
  replica, Sluice's router), against N times what one plain server on the stub makes at `--per-replica`;
- ingress: TTFT p50 of one stream at a time through a 1-replica cluster against the plain server (both on
  the stub, so the difference is what HAProxy (or Serve's proxy), the ingress and the router add);
- hit rate: the prefix cache's hit rate (hit tokens / looked-up tokens, the replicas' own counts) of a
  multi-turn workload (`--conversations` conversations sharing a system prompt, `--turns` turns each, their
  turns interleaved `--workload-concurrency` at a time) on one replica, and on `--hit-replicas` replicas
  with Sluice's router and with Ray Serve's default (power of two choices).

Writes `<out>.json`. The machine's load average is recorded with every figure: on a shared machine they move.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import server_process  # noqa: E402
from bench import serve  # noqa: E402
from bench.hostcost import DEFAULT_CACHE, tiny_model_folder  # noqa: E402

STUB = str(Path(__file__).resolve().parent / "stub_accelerator.py")
SYSTEM_PROMPT = (
    "You are the assistant of a travel agency. Answer questions about destinations, seasons, prices and "
    "bookings in two or three sentences, politely, and never invent a price you were not given."
)


def engine_flags(args: argparse.Namespace, model: Path) -> list[str]:
    return ["--device", "cpu", "--model", str(model), "--max-num-seqs", "64", "--kv-cache-gib", "0.25"]


@contextmanager
def server(args: argparse.Namespace, flags: list[str], cluster: bool) -> Iterator[str]:
    """A server on the stub (a cluster of it with `cluster`), its base URL while it runs."""
    entry = (STUB, "--step-ms", str(args.step_ms), *(("cluster",) if cluster else ()))
    proc, base = server_process.start(flags, entry=entry, timeout=600, stderr=subprocess.DEVNULL)
    try:
        yield base
    finally:
        server_process.stop(proc, timeout=90)


def load_average() -> float:
    return round(os.getloadavg()[0], 1)


def throughput(base: str, concurrency: int, args: argparse.Namespace, count_tokens) -> dict:
    options = argparse.Namespace(
        requests_per_worker=args.requests_per_worker, max_tokens=args.max_tokens, ignore_eos=True, timeout=600
    )
    asyncio.run(serve.warm_up(base, None))
    result = asyncio.run(serve.level(base, None, concurrency, options, count_tokens))
    return {**result, "load_average": load_average()}


def ttft(base: str, args: argparse.Namespace, count_tokens) -> dict:
    options = argparse.Namespace(requests_per_worker=args.ttft_requests, max_tokens=4, ignore_eos=True, timeout=600)
    result = asyncio.run(serve.level(base, None, 1, options, count_tokens))
    return {"ttft_p50_s": result["ttft_p50_s"], "ttft_p95_s": result["ttft_p95_s"], "load_average": load_average()}


def prefix_counts(base: str) -> tuple[int, int, dict[str, int]]:
    """Hit and looked-up prompt tokens, the cluster's, and each replica's looked-up tokens."""
    health = httpx.get(f"{base}/health", timeout=30).json()
    per_replica = {name: r["prefix_cache_query_tokens"] for name, r in health.get("replicas", {}).items()}
    return health["prefix_cache_hit_tokens"], health["prefix_cache_query_tokens"], per_replica


async def conversations(base: str, args: argparse.Namespace) -> None:
    """`args.conversations` conversations, a turn of each at a time, `args.workload_concurrency` requests
    in flight; each reply is a fixed text, so every prompt is the same whatever the server said."""
    histories = [
        [{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(args.conversations)
    ]  # fmt: skip
    limit = asyncio.Semaphore(args.workload_concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def turn(n: int, t: int) -> None:
            history = histories[n]
            history.append({"role": "user", "content": f"Traveller {n}, question {t}: where should I go in month {t}?"})
            async with limit:
                body = {"messages": history, "max_tokens": 8, "temperature": 0}
                response = await client.post(f"{base}/v1/chat/completions", json=body)
                response.raise_for_status()
            history.append({"role": "assistant", "content": f"Reply {t}: the coast is lovely then."})

        for t in range(args.turns):
            await asyncio.gather(*(turn(n, t) for n in range(args.conversations)))


def hit_rate(base: str, args: argparse.Namespace) -> dict:
    # The replicas publish their counts every second: what ran before has to be in the first count.
    time.sleep(2.5)
    hits, queries, per_replica = prefix_counts(base)
    started = time.perf_counter()
    asyncio.run(conversations(base, args))
    elapsed = time.perf_counter() - started
    time.sleep(2.5)
    new_hits, new_queries, new_per_replica = prefix_counts(base)
    shares = sorted(new - per_replica.get(name, 0) for name, new in new_per_replica.items())
    return {
        "hit_rate": round((new_hits - hits) / max(1, new_queries - queries), 4),
        "hit_tokens": new_hits - hits,
        "query_tokens": new_queries - queries,
        # How the workload's prompts spread over the replicas: their looked-up tokens, largest last.
        "replica_query_tokens": shares,
        "seconds": round(elapsed, 2),
        "load_average": load_average(),
    }


def cluster_flags(args: argparse.Namespace, model: Path, replicas: int, router: str = "cache-aware") -> list[str]:
    return [
        *engine_flags(args, model),
        "--replicas", str(replicas),
        "--replica-cpus", "0.5",
        "--request-router", router,
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--step-ms", type=float, default=20.0, help="the stub's step time")
    parser.add_argument("--per-replica", type=int, default=8, help="concurrent streams per replica")
    parser.add_argument("--requests-per-worker", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ttft-requests", type=int, default=30)
    parser.add_argument("--hit-replicas", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--workload-concurrency", type=int, default=8)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--out", default="bench/results/cluster", help="output path without extension")
    args = parser.parse_args()
    model = tiny_model_folder(args.cache_dir)
    count_tokens = serve.load_tokenizer(str(model))
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "scaling": [], "hit_rate": {}}

    with server(args, engine_flags(args, model), cluster=False) as base:
        results["direct"] = {
            "throughput": throughput(base, args.per_replica, args, count_tokens),
            "ttft": ttft(base, args, count_tokens),
        }
    print("direct:", json.dumps(results["direct"]), flush=True)
    for replicas in args.replicas:
        with server(args, cluster_flags(args, model, replicas), cluster=True) as base:
            row = {"replicas": replicas, **throughput(base, args.per_replica * replicas, args, count_tokens)}
            if replicas == 1:
                results["ingress_ttft"] = ttft(base, args, count_tokens)
            if replicas in (1, args.hit_replicas):
                results["hit_rate"]["one replica" if replicas == 1 else "cache-aware"] = hit_rate(base, args)
        results["scaling"].append(row)
        print("scaling:", json.dumps(row), flush=True)
    with server(args, cluster_flags(args, model, args.hit_replicas, "power-of-two"), cluster=True) as base:
        results["hit_rate"]["power-of-two"] = hit_rate(base, args)
    print("hit rate:", json.dumps(results["hit_rate"]), flush=True)

    one = results["direct"]["throughput"]["output_tokens_per_s"]
    print(f"\nstub step {args.step_ms:g} ms, {args.per_replica} streams per replica, {args.max_tokens} tokens each")
    print(f"{'replicas':>8} {'tok/s':>9} {'x one server':>13} {'load':>6}")
    for row in results["scaling"]:
        ratio = row["output_tokens_per_s"] / (one * row["replicas"])
        print(f"{row['replicas']:>8} {row['output_tokens_per_s']:>9.1f} {ratio:>12.2f}N {row['load_average']:>6}")
    direct, cluster = results["direct"]["ttft"]["ttft_p50_s"], results["ingress_ttft"]["ttft_p50_s"]
    print(f"TTFT p50: direct {direct * 1000:.1f} ms, through a 1-replica cluster {cluster * 1000:.1f} ms")
    for name, rate in results["hit_rate"].items():
        spread = " / ".join(str(n) for n in rate["replica_query_tokens"])
        counts = f"{rate['hit_tokens']}/{rate['query_tokens']} tokens; per replica {spread}"
        print(f"hit rate, {name}: {rate['hit_rate']:.3f} ({counts})")
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
