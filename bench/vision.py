"""Images in: a random-weight model of SmolVLM-256M's shape (idefics3) served with one image per request.

    python bench/vision.py                              # 1 and 16 streams against a Sluice it starts
    python bench/vision.py --peer transformers          # and `transformers serve` on the same folder (bench/peers.py)

SmolVLM-256M's decoder (30 layers of 576, 9 heads over 3 KV heads, a 1,536-wide MLP) and its SigLIP tower (12
layers of 768) and pixel-shuffle connector (scale 4), with the image scaled to fit a small CPU: `--image-size`
pixels (512 in SmolVLM; 256 here by default, 16 image tokens) and no tiling, so each image is one tile. The
model and its processor are built once under `--folder` (SmolLM2's tokenizer); each server is started on it in
turn. Each level sends `--requests-per-stream` requests per stream, each a different random image with the
same question, streamed, `--max-tokens` tokens each (ignore_eos); then one round where every stream sends the
same image after a different question (the prefix cache cannot hold its tokens: the encoder cache can).

Reported per level: TTFT p50 (ms), output tokens/s (all streams), and, for Sluice, the vision tower's share of
the level's wall time and the encoder cache's hit rate (its /health counters), on the repeated image round too.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import server_process  # noqa: E402
from engine.model.model_files import convert_gguf, default_model_gguf  # noqa: E402

QUESTION = "Describe this picture in detail."


def build_folder(folder: Path, image_size: int) -> Path:
    """SmolVLM-256M's shape with random weights, and its processor, once."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForImageTextToText,
        AutoTokenizer,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from engine.tiny_vision import TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(default_model_gguf(), Path.home() / ".cache" / "sluice"))
    image_seq_len = (image_size // 16) ** 2 // 16
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size}, do_image_splitting=False
        ),
        tokenizer=tokenizer,
        image_seq_len=image_seq_len,
        chat_template=TEMPLATE.replace("PLACEHOLDER", "<image>"),
    )
    config = AutoConfig.for_model(
        "idefics3",
        text_config=dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
        ),
        vision_config=dict(
            model_type="idefics3_vision",
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=image_size,
            patch_size=16,
        ),
        scale_factor=4,
        image_token_id=processor.image_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def image_url(seed: int, size: int) -> str:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def one(
    client: httpx.AsyncClient, base: str, model: str, url: str, question: str, max_tokens: int, ignore_eos: bool
) -> dict:
    body = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": url}}],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    started = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter()
    return {"ttft": (first or time.perf_counter()) - started, "tokens": tokens}


async def health(client: httpx.AsyncClient, base: str) -> dict:
    response = await client.get(f"{base}/health")
    return response.json() if response.status_code == 200 else {}


async def level(
    base: str, model: str, streams: int, args: argparse.Namespace, repeated: bool, ignore_eos: bool
) -> dict:
    """`streams` streams of requests; `repeated`: one round, every stream the same image after its own question."""
    async with httpx.AsyncClient(timeout=3600) as client:
        before = await health(client, base)
        started = time.perf_counter()

        async def stream(index: int) -> list[dict]:
            if repeated:
                url = image_url(10_000, args.image_size)
                question = f"Question {index}: {QUESTION}"
                return [await one(client, base, model, url, question, args.max_tokens, ignore_eos)]
            samples = []
            for k in range(args.requests_per_stream):
                url = image_url(1 + streams * 1000 + index * 100 + k, args.image_size)
                samples.append(await one(client, base, model, url, QUESTION, args.max_tokens, ignore_eos))
            return samples

        samples = [s for group in await asyncio.gather(*(stream(i) for i in range(streams))) for s in group]
        wall = time.perf_counter() - started
        after = await health(client, base)
    result = {
        "streams": streams,
        "requests": len(samples),
        "ttft_p50_ms": round(statistics.median(s["ttft"] for s in samples) * 1000, 1),
        "tokens_per_s": round(sum(s["tokens"] for s in samples) / wall, 2),
        "wall_s": round(wall, 2),
    }
    if "vision_seconds" in after:
        queries = after["image_cache_queries"] - before["image_cache_queries"]
        result["vision_share"] = round((after["vision_seconds"] - before["vision_seconds"]) / wall, 3)
        result["image_cache_hit_rate"] = round(
            (after["image_cache_hits"] - before["image_cache_hits"]) / max(1, queries), 3
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, default=Path.home() / ".cache" / "sluice-bench" / "smolvlm-256m-shape")
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--peer", choices=["transformers"], action="append", default=[])
    parser.add_argument("--out", type=Path, default=Path("bench/results/vision.json"))
    args = parser.parse_args()
    folder = build_folder(args.folder.expanduser(), args.image_size)
    results: dict[str, list[dict]] = {}
    servers = [("sluice", None), *((peer, peer) for peer in args.peer)]
    for name, peer in servers:
        if peer is None:
            proc, base = server_process.start(["--model", str(folder), "--max-model-len", "2048"], timeout=600)
            model = folder.name
        else:
            from bench import peers

            proc, base = peers.start(peer, peers.Model(folder, folder), server_process.free_port())
            model = str(folder)
        # transformers serve refuses ignore_eos (a 422); random weights write an end of sequence about once in a
        # vocabulary's worth of tokens, so its requests run to max_tokens all the same (tokens counted from usage).
        ignore_eos = peer is None
        try:
            warm = argparse.Namespace(**{**vars(args), "requests_per_stream": 1})
            asyncio.run(level(base, model, 1, warm, False, ignore_eos))
            results[name] = [asyncio.run(level(base, model, n, args, False, ignore_eos)) for n in args.concurrency]
            repeated = asyncio.run(level(base, model, max(args.concurrency), args, True, ignore_eos))
            results[name].append({"repeated_image": repeated})
        finally:
            server_process.stop(proc)
        print(name, json.dumps(results[name], indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"image_size": args.image_size, "results": results}, indent=1))


if __name__ == "__main__":
    main()
