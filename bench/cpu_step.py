"""A decode step of the default model on the CPU kernels, several ways taking turns in one process: the
decoder layers in one native call (engine/kernels/cpu/decoder.py) or op by op in torch, on each variant of the
kernels this CPU runs (engine/kernels/cpu/native.py; every variant gives the same bits).

    python bench/cpu_step.py                              # one call against op by op, 1 and 8 streams
    python bench/cpu_step.py --streams 1 8 32 64 --rounds 10
    python bench/cpu_step.py --variants avx512 avx2-fma   # the variants, each in one call
    python bench/cpu_step.py --strip-rows 6 16 --streams 8 12 64   # builds widening strips past 6 / 16 rows

Each stream decodes greedily from its own short chat prompt; the ways take turns in blocks of `--steps`
steps (the order rotating), so a busy machine slows them alike. Reports the median and best milliseconds
of a step (the forward, the head, the argmax), and each median over the first way's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# The server's OpenMP wait policy (app/__main__.py), read once when torch loads: the layers measured in this
# process wait for work as the server's threads do, or they would spin and look faster than it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.detokenizer import IncrementalDetokenizer, StopMatcher  # noqa: E402
from engine.kernels.cpu.native import choose_variant, load_library, runnable_variants  # noqa: E402
from engine.model.causal_lm import PagedCausalLM  # noqa: E402
from engine.model.host_memory import tune_collector  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.runner import Logits, Segment  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.tiny import tiny_engine  # noqa: E402
from engine.types import SamplingParams  # noqa: E402


def default_variant() -> str:
    variant = choose_variant()
    if variant is None:
        raise SystemExit("this CPU runs no variant of the kernels")
    return variant.name


def ways(
    model: PagedCausalLM, cache_dir: Path, variants: list[str] | None, strip_rows: list[int] | None
) -> dict[str, Callable[[], None]]:
    """Name → a function that sets the model up that way: each variant's kernels in one call, or (without
    `variants`) the default variant in one call and op by op; with `strip_rows`, each variant built to widen
    strips of weights past that many rows (invariant.cpp's kStripRows), in one call."""
    packed, experts, decoder = dict(model._packed), dict(model._experts), model._decoder
    if decoder is None:
        raise SystemExit("the decoder layers do not run in one call here (no CPU kernels?)")

    def on(variant_name: str, one_call: bool, rows: int | None = None) -> Callable[[], None]:
        variant = next(v for v in runnable_variants() if v.name == variant_name)
        if rows is not None:
            variant = dataclasses.replace(variant, flags=(*variant.flags, f"-DSL_STRIP_ROWS={rows}"))
        library = load_library(cache_dir, variant)
        linears = {module: dataclasses.replace(linear, library=library) for module, linear in packed.items()}
        fused = dataclasses.replace(decoder, library=library) if one_call else None
        return lambda: model.use_kernels(library, linears, experts, fused)

    if strip_rows:
        names = variants or [default_variant()]
        return {f"{name}, strips past {rows}": on(name, True, rows) for name in names for rows in strip_rows}
    if variants:
        return {f"{name}, one call": on(name, True) for name in variants}
    default = default_variant()
    return {"one call": on(default, True), "op by op": on(default, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=6, help="blocks of steps per way")
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--variants", nargs="+", help="compare these variants of the kernels, each in one call")
    parser.add_argument("--strip-rows", type=int, nargs="+", help="compare builds widening strips past these rows")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "sluice"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model(None, Path(args.cache_dir), device="cpu", dtype="auto", batch_invariant=True)
    model = loaded.model
    setups = ways(model, Path(args.cache_dir), args.variants, args.strip_rows)
    names = list(setups)
    # The prompt, then every way's blocks of steps, each after a step of warm-up.
    tokens_needed = 64 + len(names) * args.rounds * (args.steps + 1)
    engine = tiny_engine(
        loaded, max_model_len=tokens_needed, block_size=16, num_kv_blocks=max(args.streams) * (tokens_needed // 16 + 1)
    )
    # The server's collector settings: with Python's defaults a tenth of a one-stream step's samples were its passes.
    tune_collector()
    print(f"\n`python {' '.join(sys.argv)}`\n")
    headers = [f"{name} ms (best)" for name in names] + [f"{name} / {names[0]}" for name in names[1:]]
    print(f"| streams | {' | '.join(headers)} |")
    print("|---|" + "---|" * (2 * len(names) - 1))
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

        times: dict[str, list[float]] = {name: [] for name in names}
        for block in range(args.rounds * len(names)):
            way = names[(block + block // len(names)) % len(names)]
            setups[way]()
            step()  # the first step after a switch warms its caches
            for _ in range(args.steps):
                started = time.perf_counter()
                step()
                times[way].append(time.perf_counter() - started)
        setups[names[0]]()
        for request in requests:
            engine.block_manager.deallocate(request)
        medians = {way: statistics.median(t) * 1e3 for way, t in times.items()}
        cells = [f"{medians[way]:.2f} ({min(times[way]) * 1e3:.2f})" for way in names]
        ratios = [f"{medians[way] / medians[names[0]]:.2f}x" for way in names[1:]]
        print(f"| {streams} | {' | '.join(cells + ratios)} |", flush=True)


if __name__ == "__main__":
    main()
