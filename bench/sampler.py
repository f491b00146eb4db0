"""The sampler alone: torch's path against the CPU kernel on one step's worth of logits.

    python bench/sampler.py                 # 256 rows of 49,152 logits, six settings
    python bench/sampler.py --rows 64
    python bench/sampler.py --cold          # every timed call after the caches are flushed
    python bench/sampler.py --device cuda   # on a GPU: torch's path against the GPU's Triton kernel

For each setting it reports milliseconds per step on each path (the best of `--repeats`; the kernel
also as the engine runs it, given the output head's block maxima) and in how
many rows the two drew the same token (the same uniforms; they differ only where float rounding of a
sum moves a boundary). Logits are Gaussian at two scales: peaked rows (x3) and nearly flat ones (x0.1).
With `--cold`, a 64 MiB buffer (twice this machine's L3) is written before every timed call, so the
logits come from memory as they do in the engine, where the output head wrote them long before.
With `--device cuda` both paths run on the GPU (the kernel is engine/kernels/gpu/sampling.py; no block
maxima there), and a timed call includes the copy of the tokens to the host, as in the engine.

First it prints how long one read of the step's logits takes (torch's sum of them, timed the same
way): no sampler that reads every logit can take less. At 256 rows the logits (48 MiB) outgrow this
machine's L3 (32 MiB), so even without `--cold` they come from memory; at 32 rows they fit.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels.cpu.native import load_library  # noqa: E402
from engine.sampling.sampler import BLOCK, Sampler, device_kernel  # noqa: E402
from engine.types import SamplingParams  # noqa: E402


@dataclass(eq=False)
class _Row:
    """The fields of a request the sampler reads (it keys its cache of packed settings by identity)."""

    params: SamplingParams
    rng_key: int
    num_tokens: int


SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.7),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0, top_k=40),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.3, top_k=100, top_p=0.5),
]


def best_ms(call: Callable[[], object], repeats: int, flush: torch.Tensor | None = None) -> float:
    """The fastest of `repeats` timed calls, each after the flush (if any) and, on a GPU, once the
    device has finished what was queued before it."""
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.fill_(1.0)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def sample_ms(sampler: Sampler, requests, logits: torch.Tensor, repeats: int, block_max=None, flush=None) -> float:
    return best_ms(lambda: sampler.sample(requests, logits, block_max=block_max), repeats, flush)


def block_maxima(logits: torch.Tensor) -> torch.Tensor:
    """Each BLOCK-token block's max per row, as the output head's kernel hands them to the sampler."""
    rows, vocab = logits.shape
    padded = torch.full((rows, -(-vocab // BLOCK) * BLOCK), -torch.inf)
    padded[:, :vocab] = logits
    return padded.view(rows, -1, BLOCK).amax(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "sluice")
    parser.add_argument("--cold", action="store_true", help="flush the caches before every timed call")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU's kernel")
    args = parser.parse_args()
    device = torch.device(args.device)
    flush = torch.empty(16 * 2**20, device=device) if args.cold else None
    if device.type == "cpu":
        library = load_library(args.cache_dir)
        if library is None:
            sys.exit("Sluice's CPU kernels cannot run here")
        torch_path, kernel_path = Sampler(), Sampler(library)
    else:
        kernel = device_kernel(device)
        if kernel is None:
            sys.exit(f"no sampling kernel for {device} (it needs CUDA and Triton)")
        torch_path, kernel_path = Sampler(), Sampler(device=kernel)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=generator).to(device)
    print(
        f"Reading the logits once ({args.rows} x {args.vocab} float32, torch's sum): "
        f"{best_ms(lambda: logits.sum().item(), args.repeats, flush):.2f} ms\n"
    )
    print("| setting | logits scale | torch ms | kernel ms | kernel ms, given block maxima | same tokens |")
    print("|---|---|---|---|---|---|")
    for setting in SETTINGS:
        requests = [
            _Row(SamplingParams(max_tokens=1, **setting), rng_key=7919 * i + 1, num_tokens=100 + i)
            for i in range(args.rows)
        ]
        for scale in (3.0, 0.1):
            logits = (torch.randn(args.rows, args.vocab, generator=generator) * scale).to(device)
            block_max = block_maxima(logits) if device.type == "cpu" else None
            given_maxima = (
                f"{sample_ms(kernel_path, requests, logits, args.repeats, block_max, flush):.2f}"
                if block_max is not None
                else "-"
            )
            same = sum(
                a == b
                for a, b in zip(
                    torch_path.sample(requests, logits).token_ids, kernel_path.sample(requests, logits).token_ids
                )
            )
            print(
                f"| {setting} | {scale} | {sample_ms(torch_path, requests, logits, args.repeats, flush=flush):.1f} "
                f"| {sample_ms(kernel_path, requests, logits, args.repeats, flush=flush):.1f} "
                f"| {given_maxima} | {same}/{args.rows} |"
            )


if __name__ == "__main__":
    main()
