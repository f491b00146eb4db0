"""Serving benchmark for any OpenAI-compatible server: throughput, TTFT, inter-token latency, faults.

    python bench/serve.py --server sluice=http://127.0.0.1:8000
    python bench/serve.py --spawn sluice="" --spawn sluice-fp32="--dtype float32" --concurrency 1 8 32

At each concurrency level, that many workers stream chat completions back to back
over a fixed prompt set (`--requests-per-worker` each). Output tokens are counted by
re-tokenizing the received text with one local tokenizer, so every server is counted
alike. Per level it reports output tokens/s, requests/s, TTFT p50/p95, inter-token
latency p50/p95 (gaps between content chunks, per token), end-to-end p50, and protocol
faults (HTTP errors, bad JSON, a missing or repeated finish_reason, a missing [DONE]).
Streams are read with a bare asyncio protocol (`SSEResponse`), cheap enough per chunk that
the client does not become what is measured at hundreds of streams.
Writes `<out>.json` and, with matplotlib installed (`pip install -e .[bench]`), `<out>.png`:
throughput and TTFT against concurrency, one line per server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import server_process  # noqa: E402
from bench import peers  # noqa: E402
from bench.peers import Model  # noqa: E402

TASKS = [
    "Write a short story about",
    "Explain in simple words",
    "Describe",
    "Give me five facts about",
    "Write a poem about",
    "Tell me the history of",
    "What would a child ask about",
    "Write a product review of",
]
SUBJECTS = [
    "a lighthouse keeper",
    "how a steam engine works",
    "a journey across a desert",
    "baking bread",
    "friendship",
    "the bicycle",
    "the sea",
    "how airplanes fly",
    "volcanoes",
    "the moon",
    "a busy train station",
    "honey bees",
    "chess",
    "the printing press",
    "a rainy city",
    "coffee",
]
# Every request of a sweep up to 64 streams x 2 requests asks something different, so a
# prefix cache finds only what real traffic shares (the chat template's system prompt).
PROMPTS = [f"{task} {subject}." for subject in SUBJECTS for task in TASKS]


@dataclass
class Sample:
    """One request as the client saw it."""

    ttft: float | None = None
    latency: float = 0.0
    # (seconds since the previous content chunk, that chunk's text), after the first chunk.
    gaps: list[tuple[float, str]] = field(default_factory=list)
    text: str = ""
    fault: str | None = None


class SSEResponse(asyncio.Protocol):
    """One streamed response read off a bare asyncio connection (`Connection: close`): the status, the
    body (chunked or not) cut into lines, and each `data:` line handed to `on_data` as it arrives.

    Not httpx: at hundreds of streams on a GPU, httpx's pure-Python HTTP stack and connection pool cost
    the client about 170 µs of CPU per chunk, and the sweep measured its own client (docs/performance.md,
    "Method"). This costs a few tens."""

    def __init__(self, on_data, finished: asyncio.Future) -> None:
        self.on_data = on_data
        self.finished = finished
        self.status: int | None = None
        self._head = b""
        self._chunked = False
        self._raw = b""  # chunked-encoded bytes not yet decoded
        self._lines = b""  # decoded body after the last complete line

    def data_received(self, data: bytes) -> None:
        if self.status is None:
            self._head += data
            if b"\r\n\r\n" not in self._head:
                return
            head, _, data = self._head.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            self.status = int(lines[0].split()[1])
            self._chunked = any(
                line.lower().startswith("transfer-encoding:") and "chunked" in line.lower() for line in lines[1:]
            )
        self._body(self._dechunk(data) if self._chunked else data)

    def _dechunk(self, data: bytes) -> bytes:
        self._raw += data
        out = []
        while True:
            line_end = self._raw.find(b"\r\n")
            if line_end < 0:
                break
            size = int(self._raw[:line_end].split(b";")[0] or b"0", 16)
            if len(self._raw) < line_end + 2 + size + 2:
                break
            out.append(self._raw[line_end + 2 : line_end + 2 + size])
            self._raw = self._raw[line_end + 2 + size + 2 :]
        return b"".join(out)

    def _body(self, data: bytes) -> None:
        *lines, self._lines = (self._lines + data).split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                self.on_data(line[5:].strip().decode())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lines.startswith(b"data:"):
            self.on_data(self._lines[5:].strip().decode())
        if not self.finished.done():
            self.finished.set_result(exc)


def chat_request(host: str, body: bytes) -> bytes:
    """A chat completion's POST for a bare connection, which the server closes once it has answered."""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def one_request(
    base: str, model: str | None, prompt: str, max_tokens: int, ignore_eos: bool = False, timeout: float = 300
) -> Sample:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": True,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    sample = Sample()
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    start = last = time.perf_counter()
    finishes, done = 0, False

    def on_data(data: str) -> None:
        nonlocal last, finishes, done
        if data == "[DONE]":
            done = True
            # The stream is over, whether or not the server closes the connection.
            if not finished.done():
                finished.set_result(None)
            return
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            sample.fault = "bad JSON"
            return
        if "error" in payload:
            sample.fault = f"error event: {payload['error'].get('message')}"
        for choice in payload.get("choices", []):
            content = (choice.get("delta") or {}).get("content")
            if content:
                now = time.perf_counter()
                if sample.ttft is None:
                    sample.ttft = now - start
                else:
                    sample.gaps.append((now - last, content))
                last = now
                sample.text += content
            finishes += choice.get("finish_reason") is not None

    url = urlsplit(base)
    transport = None
    try:
        transport, response = await loop.create_connection(
            lambda: SSEResponse(on_data, finished), url.hostname, url.port or 80
        )
        transport.write(chat_request(url.netloc, json.dumps(body).encode()))
        error = await asyncio.wait_for(finished, timeout)
        if response.status != 200:
            sample.fault = f"HTTP {response.status}"
        elif error is not None:
            sample.fault = f"{type(error).__name__}: {error}"
    except (OSError, asyncio.TimeoutError) as exc:
        sample.fault = f"{type(exc).__name__}: {exc}"
    finally:
        if transport is not None:
            transport.close()
    sample.latency = time.perf_counter() - start
    if sample.fault is None and (finishes != 1 or not done):
        sample.fault = f"{finishes} finish_reason chunks, [DONE] {'seen' if done else 'missing'}"
    return sample


async def warm_up(base: str, model: str | None) -> None:
    await one_request(base, model, PROMPTS[0], 8)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


async def level(base: str, model: str | None, concurrency: int, args: argparse.Namespace, count_tokens) -> dict:
    async def worker(index: int) -> list[Sample]:
        samples = []
        for turn in range(args.requests_per_worker):
            prompt = PROMPTS[(turn * concurrency + index) % len(PROMPTS)]
            samples.append(
                await one_request(base, model, prompt, args.max_tokens, args.ignore_eos, timeout=args.timeout)
            )
        return samples

    start = time.perf_counter()
    samples = [s for batch in await asyncio.gather(*[worker(i) for i in range(concurrency)]) for s in batch]
    elapsed = time.perf_counter() - start
    tokens = [count_tokens(s.text) for s in samples]
    # A chunk can carry several tokens (speculative bursts, stream_interval): spread its gap over them.
    itl = [gap / max(1, count_tokens(text)) for s in samples for gap, text in s.gaps]
    ttfts = [s.ttft for s in samples if s.ttft is not None]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "output_tokens": sum(tokens),
        "output_tokens_per_s": round(sum(tokens) / elapsed, 2),
        "requests_per_s": round(len(samples) / elapsed, 3),
        "ttft_p50_s": rounded(percentile(ttfts, 0.5), 4),
        "ttft_p95_s": rounded(percentile(ttfts, 0.95), 4),
        "itl_p50_s": rounded(percentile(itl, 0.5), 4),
        "itl_p95_s": rounded(percentile(itl, 0.95), 4),
        "e2e_p50_s": rounded(percentile([s.latency for s in samples], 0.5)),
        "faults": sorted({s.fault for s in samples if s.fault}),
        "num_faults": sum(1 for s in samples if s.fault),
    }


def default_model(gguf: Path | None = None) -> Model:
    """The embedded default model (or another GGUF): its converted folder (made on first use) and its GGUF."""
    from engine.model.model_files import convert_gguf, default_model_gguf

    gguf = gguf or default_model_gguf()
    cache = Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice"))
    return Model(folder=convert_gguf(gguf, cache), gguf=gguf)


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path or default_model().folder)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


def spawn(
    flags: str, entry: tuple[str, ...] = ("-m", "app"), checkout: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """A Sluice server with `flags` on a free port; `entry` is what Python runs (a script that
    wraps the server, as bench/stub_accelerator.py does), from `checkout` (another worktree, for
    a before / after comparison) or this one."""
    return server_process.start(shlex.split(flags), entry, cwd=checkout)


def plot(results: dict[str, list[dict]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, levels in results.items():
        x = [r["concurrency"] for r in levels]
        throughput.plot(x, [r["output_tokens_per_s"] for r in levels], marker="o", label=name)
        ttft.plot(x, [r["ttft_p50_s"] for r in levels], marker="o", label=name)
    for axis, title, unit in ((throughput, "Output throughput", "tokens/s"), (ttft, "Time to first token (p50)", "s")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", default=[], help="NAME=BASE_URL of a running server")
    parser.add_argument("--spawn", action="append", default=[], help='NAME="sluice flags": start Sluice for the run')
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=["transformers", "llama-server"],
        help="start a peer server on the default model (installed by bench/peers.py into its own environment)",
    )
    parser.add_argument("--peer-gguf", type=Path, help="a GGUF file the peers serve instead of the default model")
    parser.add_argument("--model", help="the `model` field to send (peers may need it)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--requests-per-worker", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true", help="fixed-length outputs (Sluice and vLLM extension)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--tokenizer", help="tokenizer folder for counting (default: the default model's)")
    parser.add_argument("--out", default="bench/results/serve", help="output path without extension")
    args = parser.parse_args()
    if not args.server and not args.spawn and not args.peer:
        args.server = ["sluice=http://127.0.0.1:8000"]
    count_tokens = load_tokenizer(args.tokenizer)

    def start(kind: str, where: str) -> tuple[subprocess.Popen | None, str]:
        if kind == "spawn":
            return spawn(where)
        if kind == "peer":
            return peers.start(where, default_model(args.peer_gguf), server_process.free_port())
        return None, where

    results: dict[str, list[dict]] = {}
    targets = [(spec.split("=", 1)[0], "server", spec.split("=", 1)[1]) for spec in args.server]
    targets += [(spec.split("=", 1)[0], "spawn", spec.split("=", 1)[1] if "=" in spec else "") for spec in args.spawn]
    targets += [(peer, "peer", peer) for peer in args.peer]
    for name, kind, where in targets:
        proc, base = start(kind, where)
        try:
            # One untimed request first: some servers load or compile on their first request.
            asyncio.run(warm_up(base, args.model))
            results[name] = []
            for concurrency in args.concurrency:
                report = asyncio.run(level(base, args.model, concurrency, args, count_tokens))
                results[name].append(report)
                print(name, json.dumps(report), flush=True)
        finally:
            if proc:
                proc.terminate()
                proc.wait()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out.with_suffix('.json')}")
    if plot(results, out.with_suffix(".png")):
        print(f"wrote {out.with_suffix('.png')}")
    else:
        print("matplotlib is not installed: no plot (pip install -e .[bench])")


if __name__ == "__main__":
    main()
