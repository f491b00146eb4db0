"""Where serving throughput goes: the raw forward, the engine, and HTTP, at the same batch sizes.

    python bench/engine.py                       # raw forward and engine at 1, 8, 32, 64
    python bench/engine.py --http                # plus a Sluice server driven by bench/serve.py
    python bench/engine.py --flags "--dtype float32" --concurrency 1 32

- `raw`: the model's paged forward plus a greedy argmax, decoding a batch of the benchmark's
  chat prompts for `--max-tokens` steps; no scheduler, no sampling parameters, no streams.
  Tokens/s = batch size / step time.
- `engine`: bench/serve.py's workload (its chat prompts, temperature 0.7, workers submitting
  back to back), but every request runs to `--max-tokens` (ignore_eos) like the raw forward's,
  submitted straight into the Engine; output tokens/s counted from the token ids the channels
  deliver, and TTFT p50. Prefills, sampling, scheduling and streams are what it adds.
- `http`: bench/serve.py's sweep with `--ignore-eos` against a Sluice server started with the
  same flags.

Everything that runs torch runs on one thread, as in the server (see Engine.run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

# The server's OpenMP wait policy (app/__main__.py), read once when torch loads: the layers measured in this
# process wait for work as the server's threads do, or they would spin and look faster than it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from pydantic_settings import CliApp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.settings import Settings  # noqa: E402
from app.state import ServerState, build_state  # noqa: E402
from bench import serve  # noqa: E402
from engine.channel import StreamChannel  # noqa: E402
from engine.detokenizer import IncrementalDetokenizer, StopMatcher  # noqa: E402
from engine.model.host_memory import keep_freed_memory, return_freed_memory, tune_collector  # noqa: E402
from engine.model.runner import Logits, Segment  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

T = TypeVar("T")


def prompt_ids(state: ServerState, index: int) -> list[int]:
    messages = [{"role": "user", "content": serve.PROMPTS[index % len(serve.PROMPTS)]}]
    return state.loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]


def raw_requests(state: ServerState, batch: int, steps: int) -> list[Request]:
    """`batch` requests of the benchmark's prompts with cache blocks for `steps` decode steps, outside
    the scheduler; the caller deallocates them."""
    params = SamplingParams(max_tokens=steps, temperature=0.0)
    requests = []
    for i in range(batch):
        request = Request(
            request_id=f"raw-{i}",
            prompt_token_ids=prompt_ids(state, i),
            params=params,
            channel=None,
            detokenizer=IncrementalDetokenizer(state.loaded.token_bytes),
            stop_matcher=StopMatcher(()),
        )
        state.engine.block_manager.allocate(request, request.num_tokens + steps)
        requests.append(request)
    return requests


def prefill_segments(requests: list[Request]) -> list[Segment]:
    """Each request's whole prompt, its last token's logits wanted."""
    return [Segment(r, 0, r.token_ids, Logits.LAST) for r in requests]


def decode_segments(requests: list[Request], token_ids: list[int]) -> list[Segment]:
    """Each request's next token appended, and its decode."""
    segments = []
    for request, token_id in zip(requests, token_ids):
        request.token_ids.append(token_id)
        segments.append(Segment(request, request.num_tokens - 1, [token_id], Logits.LAST))
    return segments


def greedy_tokens(state: ServerState, segments: list[Segment]) -> list[int]:
    """One forward of the bare runner over `segments`; each segment's argmax token."""
    return state.engine.runner.run(segments).logits.argmax(dim=-1).tolist()


def raw_forward(state: ServerState, batch: int, steps: int) -> float:
    """Decode tokens/s of the bare paged forward at `batch`, after prefilling the prompts."""
    requests = raw_requests(state, batch, steps)
    try:
        next_ids = greedy_tokens(state, prefill_segments(requests))
        elapsed = 0.0
        for step in range(steps):
            segments = decode_segments(requests, next_ids)
            start = time.perf_counter()
            next_ids = greedy_tokens(state, segments)
            if step:  # the first step warms this batch shape up
                elapsed += time.perf_counter() - start
        return batch * (steps - 1) / elapsed
    finally:
        for request in requests:
            state.engine.block_manager.deallocate(request)


async def engine_level(state: ServerState, concurrency: int, args: argparse.Namespace) -> dict:
    """bench/serve.py's workload, straight into the engine."""
    loop = asyncio.get_running_loop()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, ignore_eos=True)
    ttfts: list[float] = []
    counts: list[int] = []

    async def one(index: int) -> None:
        channel = StreamChannel(loop, num_choices=1)
        start = time.perf_counter()
        state.engine.submit(f"bench-{index}", prompt_ids(state, index), params, channel)
        tokens = 0
        async for chunk in channel:
            if chunk.token_ids and not tokens:
                ttfts.append(time.perf_counter() - start)
            tokens += len(chunk.token_ids)
        counts.append(tokens)

    async def worker(index: int) -> None:
        for turn in range(args.requests_per_worker):
            await one(turn * concurrency + index)

    start = time.perf_counter()
    await asyncio.gather(*[worker(i) for i in range(concurrency)])
    elapsed = time.perf_counter() - start
    return {
        "output_tokens_per_s": round(sum(counts) / elapsed, 2),
        "ttft_p50_s": serve.rounded(serve.percentile(ttfts, 0.5)),
    }


def start_engine_thread(settings: Settings, first: Callable[[ServerState], T]) -> tuple[ServerState, T]:
    """Build the server state on a new thread, run `first(state)` there, then the engine loop: every
    torch op on one thread, as in the server. Returns once the engine runs."""
    ready: dict[str, object] = {}
    started = threading.Event()

    def torch_thread() -> None:
        try:
            state = build_state(settings)
            tune_collector()
            return_freed_memory()
            ready["first"] = first(state)
            ready["state"] = state
        except BaseException as exc:  # noqa: BLE001 - reported by the calling thread
            ready["error"] = exc
            started.set()
            return
        state.engine.run(on_running=started.set)

    keep_freed_memory()
    threading.Thread(target=torch_thread, name="bench-engine", daemon=True).start()
    started.wait()
    if "error" in ready:
        raise ready["error"]
    return ready["state"], ready["first"]


def run_in_process(args: argparse.Namespace, settings: Settings) -> dict[int, dict]:
    """Raw and engine figures per concurrency level, torch confined to one thread."""
    state, raw = start_engine_thread(
        settings, lambda state: {c: raw_forward(state, c, args.max_tokens) for c in args.concurrency}
    )
    results = {}
    try:
        for concurrency in args.concurrency:
            results[concurrency] = {"raw_tokens_per_s": round(raw[concurrency], 2)}
            report = asyncio.run(engine_level(state, concurrency, args))
            results[concurrency] |= {f"engine_{key}": value for key, value in report.items()}
            print(concurrency, json.dumps(results[concurrency]), flush=True)
    finally:
        state.engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", default="", help="Sluice flags for every layer (dtype, block size, ...)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--requests-per-worker", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--http", action="store_true", help="also run bench/serve.py against a spawned server")
    parser.add_argument("--out", default="bench/results/engine.json")
    args = parser.parse_args()
    # Every request runs to --max-tokens in every layer, as the raw forward's sequences do.
    args.ignore_eos = True
    settings = CliApp.run(Settings, cli_args=shlex.split(args.flags))
    torch.set_grad_enabled(False)

    results = run_in_process(args, settings)
    if args.http:
        count_tokens = serve.load_tokenizer(None)
        proc, base = serve.spawn(args.flags)
        try:
            for concurrency in args.concurrency:
                report = asyncio.run(serve.level(base, None, concurrency, args, count_tokens))
                results[concurrency]["http_tokens_per_s"] = report["output_tokens_per_s"]
                results[concurrency]["http_ttft_p50_s"] = report["ttft_p50_s"]
        finally:
            proc.terminate()
            proc.wait()

    print("\n| streams | raw forward tok/s | engine tok/s | engine / raw | HTTP tok/s | HTTP / engine |")
    print("|---|---|---|---|---|---|")
    for concurrency, r in results.items():
        raw, engine, http = r["raw_tokens_per_s"], r["engine_output_tokens_per_s"], r.get("http_tokens_per_s")
        http_cells = f"{http} | {http / engine:.2f}" if http else "- | -"
        print(f"| {concurrency} | {raw} | {engine} | {engine / raw:.2f} | {http_cells} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
