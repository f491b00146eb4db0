"""The CPU's batch-invariant paged attention alone (sl_paged_attention) over decode tokens, on each variant of the
kernels this CPU runs and on other builds given as library files (another checkout's, say): microseconds a call.

    python bench/cpu_attention.py                                  # the default model's heads, 32 tokens
    python bench/cpu_attention.py --tokens 1 32 --context 128 512 --library main=/path/to/invariant-....so

Each token is one request's decode step over `--context` cached keys of its own (random float32 keys and
values, its blocks one after another in the pool); with `--from-memory` the calls take 30 caches in turn, as a
step's 30 layers do, their blocks in random order, as a pool that has served a while hands them out, so the
keys come from memory rather than the CPU's caches. The default shape is SmolLM2-135M's: 9 query heads over 3
KV heads of 64. The builds take turns, `--trials` times each; the best trial counts. Every build's output
must be the same bits.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_builds import add_build_arguments, kernel_builds, print_table_head  # noqa: E402
from engine.kernels.cpu.invariant import KernelAttentionMetadata, invariant_paged_attention  # noqa: E402

BLOCK_SIZE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30, help="calls a trial")
    parser.add_argument("--from-memory", action="store_true", help="30 caches in turn, blocks in random order")
    add_build_arguments(parser)
    args = parser.parse_args()
    builds = kernel_builds(args)
    print_table_head(["tokens", "context"], builds, "µs")
    generator = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        for context in args.context:
            blocks = -(-context // BLOCK_SIZE)
            shape = (tokens * blocks * BLOCK_SIZE, args.kv_heads, args.head_dim)
            caches = [
                (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
                for _ in range(30 if args.from_memory else 1)
            ]
            q = torch.randn(tokens, args.heads, args.head_dim, generator=generator)
            count = tokens * blocks
            order = torch.randperm(count, generator=generator) if args.from_memory else torch.arange(count)
            tables = order.view(tokens, blocks)
            rows = torch.arange(tokens, dtype=torch.int64)
            lengths = torch.full((tokens,), context, dtype=torch.int64)
            best = dict.fromkeys(builds, float("inf"))
            outputs: dict[str, torch.Tensor] = {}
            for _ in range(args.trials):
                for name, library in builds.items():
                    meta = KernelAttentionMetadata(library, tables, rows, lengths, BLOCK_SIZE)
                    start = time.perf_counter()
                    for call in range(args.calls):
                        k, v = caches[call % len(caches)]
                        outputs[name] = invariant_paged_attention(q, k, v, meta, args.head_dim**-0.5)
                    best[name] = min(best[name], (time.perf_counter() - start) / args.calls * 1e6)
            first = next(iter(outputs.values()))
            if not all(torch.equal(first, out) for out in outputs.values()):
                raise SystemExit(f"the builds' outputs differ at {tokens} tokens, context {context}")
            print(f"| {tokens} | {context} | {' | '.join(f'{best[name]:.0f}' for name in builds)} |")


if __name__ == "__main__":
    main()
