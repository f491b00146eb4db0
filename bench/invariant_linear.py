"""The GPU's batch-invariant linear kernel against torch's (cuBLAS), on a real model's layer shapes.

    python bench/invariant_linear.py                       # Llama-1B's layers, bfloat16
    python bench/invariant_linear.py --shape llama-8b
    python bench/invariant_linear.py --tiles 16x16 128x64 128x128x8   # other tiles: BLOCK_MxBLOCK_N[xWARPS]
    python bench/invariant_linear.py --graphs --tiles 64x16x4x6x128    # calls replayed from a CUDA graph

For each layer as a step runs it (q/k/v stacked, o, gate/up stacked, down, the head) and row count (a
decode step of 1 to 256 rows, a prefill step of 2048 tokens) it reports microseconds per call, the best
of `--repeats` CUDA-event timings, for torch and for the kernel; the RMSNorm likewise. Launched one by
one, calls of up to a few hundred rows are launch-bound (30 to 45 µs a call on the H100 machine);
`--graphs` replays them from a CUDA graph, as a decode step does, which is the timing to tune the decode
tiles by. A last column says whether every row's bits are the same as when that row is computed alone:
always for the kernel (its point), and for torch on this GPU as measured. `--tiles` adds columns for
other tiles, and whether their bits equal the default tiles' bits (a tile chosen by row count keeps
invariance only where they do; a BLOCK_K other than the default changes the order of the sums, so only a
layer's own shape may choose it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.kernels.gpu.invariant import InvariantRMSNorm, LinearConfig, invariant_linear, linear_config  # noqa: E402

# (hidden, intermediate, query heads, KV heads, head size, vocabulary, layers)
SHAPES = {
    "llama-1b": (2048, 8192, 32, 8, 64, 49152, 16),
    "llama-8b": (4096, 14336, 32, 8, 128, 49152, 32),
    "smollm2-135m": (576, 1536, 9, 3, 64, 49152, 30),
}
ROWS = (1, 16, 64, 256, 2048)


def _time_us(fn, repeats: int, graph: bool) -> float:
    """µs a call, the best of `repeats` timings of 10 calls: launched one by one, or (graph) replayed
    from one CUDA graph of the 10, as a decode step runs them, so no launch cost is counted."""
    fn()
    run = fn
    if graph:
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(10):
                fn()
        run = captured.replay
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph:
            run()
        else:
            for _ in range(10):
                run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 100)
    return best


def _alone_equal(fn, x) -> bool:
    together = fn(x)
    return all(torch.equal(fn(x[i : i + 1]), together[i : i + 1]) for i in (0, x.shape[0] // 2, x.shape[0] - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="llama-1b")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--tiles", nargs="*", default=[], help="other tiles to time: BLOCK_MxBLOCK_N[xWARPS[xSTAGES[xBLOCK_K]]]"
    )
    parser.add_argument("--graphs", action="store_true", help="time calls replayed from a CUDA graph")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="row counts to time")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    hidden, intermediate, heads, kv_heads, head_dim, vocab, num_layers = SHAPES[args.shape]
    layers = {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (heads * head_dim, hidden),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
        "head": (vocab, hidden),
    }
    extra = [[*map(int, t.split("x")), 0, 0, 0][:5] for t in args.tiles]
    print(f"{args.shape} on {torch.cuda.get_device_name()}, bfloat16, µs a call (best of {args.repeats} x 10)")
    header = "| layer | rows | torch | kernel | kernel / torch | torch rows invariant |"
    header += "".join(f" {t} | same bits |" for t in args.tiles)
    print(header)
    print("|" + "---|" * (6 + 2 * len(extra)))
    totals = {}
    for name, (out_features, in_features) in layers.items():
        weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) / in_features**0.5
        for rows in args.rows:
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            out_dtype = torch.float32 if name == "head" else torch.bfloat16

            def torch_linear(x=x):
                return torch.nn.functional.linear(x, weight)

            def kernel(x=x):
                return invariant_linear(x, weight, out_dtype)

            assert _alone_equal(kernel, x), (name, rows)
            t_torch = _time_us(torch_linear, args.repeats, args.graphs)
            t_kernel = _time_us(kernel, args.repeats, args.graphs)
            torch.testing.assert_close(kernel().float(), torch_linear().float(), rtol=2e-2, atol=2e-2)
            totals.setdefault(rows, [0.0, 0.0])
            # A forward's calls of this shape: one a layer, one head.
            weight_count = 1 if name == "head" else num_layers
            totals[rows][0] += weight_count * t_torch
            totals[rows][1] += weight_count * t_kernel
            line = f"| {name} | {rows} | {t_torch:.1f} | {t_kernel:.1f} | {t_kernel / t_torch:.2f} | "
            line += f"{_alone_equal(torch_linear, x)} |"
            reference = kernel()
            for block_m, block_n, warps, stages, block_k in extra:
                base = linear_config(out_features, rows)
                config = LinearConfig(
                    block_m, block_n, block_k or base.block_k, warps or base.num_warps, stages or base.num_stages
                )

                def tiled(x=x, config=config):
                    return invariant_linear(x, weight, out_dtype, config)

                line += f" {_time_us(tiled, args.repeats, args.graphs):.1f} | {torch.equal(tiled(), reference)} |"
            print(line)
    print()
    print("| rows | a forward's linear layers, torch µs | kernel µs | kernel / torch |")
    print("|---|---|---|---|")
    for rows, (t_torch, t_kernel) in totals.items():
        print(f"| {rows} | {t_torch:.0f} | {t_kernel:.0f} | {t_kernel / t_torch:.2f} |")
    print()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf_norm = LlamaRMSNorm(hidden).to("cuda", torch.bfloat16)
    kernel_norm = InvariantRMSNorm.of(hf_norm)
    print("| RMSNorm rows | Hugging Face µs | kernel µs | HF rows invariant |")
    print("|---|---|---|---|")
    for rows in args.rows:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        assert _alone_equal(kernel_norm, x)
        t_hf = _time_us(lambda x=x: hf_norm(x), args.repeats, args.graphs)
        t_kernel = _time_us(lambda x=x: kernel_norm(x), args.repeats, args.graphs)
        print(f"| {rows} | {t_hf:.1f} | {t_kernel:.1f} | {_alone_equal(hf_norm, x)} |")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
