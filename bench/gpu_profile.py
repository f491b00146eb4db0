"""Where a decode step's GPU time goes: the kernels of the bare paged forward, as the engine runs it
(graphs replayed unless the flags say `--enforce-eager`), under torch's profiler.

    python bench/gpu_profile.py --tokenizer T                         # Llama-1B shape, 1 and 256 rows
    python bench/gpu_profile.py --tokenizer T --batch 1 --flags "--kv-cache-gib 4 --no-batch-invariant"

For each batch it reports the step's wall time, the kernels one step launches, their summed GPU time
(the rest of the step is the GPU waiting: launches, gaps between kernels, the host), and the kernels
that take the most of it: the list to read before fusing kernels.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from pydantic_settings import CliApp
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.settings import Settings  # noqa: E402
from app.state import build_state  # noqa: E402
from bench.engine import decode_segments, greedy_tokens, prefill_segments, raw_requests  # noqa: E402
from bench.gpu import SHAPES, shape_folder  # noqa: E402


def profile_batch(state, batch: int, steps: int, top: int) -> None:
    # Warm-up, timed and profiled steps.
    requests = raw_requests(state, batch, 5 + 2 * steps)

    def step(next_ids):
        return greedy_tokens(state, decode_segments(requests, next_ids))

    try:
        next_ids = greedy_tokens(state, prefill_segments(requests))
        for _ in range(5):
            next_ids = step(next_ids)
        start = time.perf_counter()
        for _ in range(steps):
            next_ids = step(next_ids)
        wall_ms = (time.perf_counter() - start) * 1000 / steps
        with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
            for _ in range(steps):
                next_ids = step(next_ids)
            torch.cuda.synchronize()
    finally:
        for request in requests:
            state.engine.block_manager.deallocate(request)
    kernels: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            # µs on the device; torch 2.5's name for it was cuda_time_total.
            kernels[event.name].append(getattr(event, "device_time_total", None) or event.cuda_time_total)
    count = sum(map(len, kernels.values())) / steps
    busy_us = sum(map(sum, kernels.values())) / steps
    print(
        f"\n{batch} rows: {wall_ms:.3f} ms a step (unprofiled), {count:.0f} kernels a step, "
        f"{busy_us / 1000:.3f} ms of GPU time in them ({busy_us / 10 / wall_ms:.0f}% of the step)"
    )
    print("| kernel | calls a step | µs a step | share of GPU time |")
    print("|---|---|---|---|")
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))
    for name, times in ranked[:top]:
        per_step = sum(times) / steps
        print(f"| {name[:90]} | {len(times) / steps:.0f} | {per_step:.1f} | {per_step / busy_us:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="llama-1b")
    parser.add_argument("--tokenizer", type=Path, help="a folder holding the default model's tokenizer")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "sluice")
    parser.add_argument("--flags", default="--kv-cache-gib 8", help="Sluice flags")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    folder = shape_folder(args.shape, args.cache_dir, args.tokenizer)
    flags = f"--model {folder} --max-num-seqs {max(args.batch)} {args.flags}"
    print(f"`python bench/gpu_profile.py` on {torch.cuda.get_device_name()}: {flags}")
    state = build_state(CliApp.run(Settings, cli_args=shlex.split(flags)))
    try:
        with torch.inference_mode():
            for batch in args.batch:
                profile_batch(state, batch, args.steps, args.top)
    finally:
        state.engine.shutdown()


if __name__ == "__main__":
    main()
