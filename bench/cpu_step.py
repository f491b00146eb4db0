"""A decode step of the default model on the CPU kernels, two ways taking turns in one process: the decoder
layers in one native call (engine/kernels/decoder.py) against the same layers op by op in torch.

    python bench/cpu_step.py                              # 1 and 8 streams
    python bench/cpu_step.py --streams 1 8 32 64 --rounds 10

Each stream decodes greedily from its own short chat prompt; the two ways alternate in blocks of `--steps`
steps (which goes first alternates too), so a busy machine slows both alike. Reports the median and best
milliseconds of a step (the forward, the head, the argmax), and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.detokenizer import IncrementalDetokenizer, StopMatcher  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.runner import Logits, Segment  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.tiny import tiny_engine  # noqa: E402
from engine.types import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=6, help="blocks of steps per way")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "sluice"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(None, Path(args.cache_dir), device="cpu", dtype="auto", batch_invariant=True)
    model = loaded.model
    one_call = model._decoder
    if one_call is None:
        raise SystemExit("the decoder layers do not run in one call here (no CPU kernels?)")
    tokens_needed = 64 + 2 * args.rounds * (args.steps + 1)
    engine = tiny_engine(
        loaded, max_model_len=tokens_needed, block_size=16, num_kv_blocks=max(args.streams) * (tokens_needed // 16 + 1)
    )
    print(f"\n`python {' '.join(sys.argv)}`\n")
    print("| streams | one call ms (best) | op by op ms (best) | op by op / one call |")
    print("|---|---|---|---|")
    for streams in args.streams:
        requests = []
        for i in range(streams):
            messages = [{"role": "user", "content": f"Tell me a story about the number {i}."}]
            prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
            request = Request(
                request_id=f"s{i}",
                prompt_token_ids=list(prompt["input_ids"]),
                params=SamplingParams(max_tokens=tokens_needed, temperature=0.0),
                channel=None,
                detokenizer=IncrementalDetokenizer(engine.token_bytes),
                stop_matcher=StopMatcher(()),
            )
            engine.block_manager.allocate(request, tokens_needed)
            requests.append(request)
        runner = engine.runner
        next_ids = runner.run([Segment(r, 0, r.token_ids, Logits.LAST) for r in requests]).logits.argmax(-1).tolist()

        def step() -> None:
            nonlocal next_ids
            segments = []
            for request, token_id in zip(requests, next_ids):
                request.token_ids.append(token_id)
                segments.append(Segment(request, request.num_tokens - 1, [token_id], Logits.LAST))
            next_ids = runner.run(segments).logits.argmax(-1).tolist()

        times: dict[str, list[float]] = {"one call": [], "op by op": []}
        for block in range(args.rounds * 2):
            way = ("one call", "op by op")[(block + block // 2) % 2]
            model._decoder = one_call if way == "one call" else None
            step()  # the first step after a switch warms its caches
            for _ in range(args.steps):
                started = time.perf_counter()
                step()
                times[way].append(time.perf_counter() - started)
        model._decoder = one_call
        for request in requests:
            engine.block_manager.deallocate(request)
        fused, unfused = (statistics.median(times[way]) * 1e3 for way in ("one call", "op by op"))
        best = {way: min(t) * 1e3 for way, t in times.items()}
        print(
            f"| {streams} | {fused:.2f} ({best['one call']:.2f}) | {unfused:.2f} ({best['op by op']:.2f}) "
            f"| {unfused / fused:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
