"""Tokens/s per model family at the real sizes of its small members, random weights: Sluice against
`transformers serve --continuous-batching` (bench/peers.py) on the same folder, in the same run, with
bench/serve.py's workload (chat streams of `--max-tokens` tokens, each stream's requests back to back).

    python bench/families.py                                  # Gemma-3-270M and Qwen3-0.6B, 1 and 32 streams
    python bench/families.py --families smollm3 --concurrency 1   # SmolLM3-3B: 12 GB a server in float32

Each model is built once under `--folder` with its real shape and vocabulary (SmolLM2's tokenizer, its
vocabulary padded with placeholder tokens to the model's size so every id the random model writes
decodes). Random weights never choose to stop before `--max-tokens` (an end-of-sequence id is one of the
whole vocabulary), so a server's tokens/s is its requests/s times `--max-tokens`, counted alike for both;
a request that ended otherwise is counted as a fault. Servers run one after the other, float32 both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import server_process  # noqa: E402
from bench import peers  # noqa: E402
from bench.serve import level, spawn, warm_up  # noqa: E402
from engine.model.model_files import convert_gguf, default_model_gguf  # noqa: E402

# Each family's small member: its name and config fields (from the released config.json files).
SHAPES: dict[str, tuple[str, dict]] = {
    "gemma3_text": (
        "Gemma-3-270M",
        dict(
            vocab_size=262144,
            hidden_size=640,
            intermediate_size=2048,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            query_pre_attn_scalar=256,
            max_position_embeddings=32768,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "qwen3": (
        "Qwen3-0.6B",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "smollm3": (
        "SmolLM3-3B",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            max_position_embeddings=65536,
            no_rope_layer_interval=4,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0},
        ),
    ),
}


def build(model_type: str, folder: Path) -> Path:
    """The family's random-weight model of its small member's shape in `folder` (built once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    name, shape = SHAPES[model_type]
    target = folder / name
    if (target / "config.json").is_file():
        return target
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    staging = folder / f".{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    _padded_tokenizer(shape["vocab_size"], staging)
    staging.rename(target)
    return target


def _padded_tokenizer(vocab_size: int, folder: Path) -> None:
    """SmolLM2's tokenizer with placeholder tokens up to `vocab_size`: byte-level pieces no merge makes (so
    encoding is unchanged), each decoding to a space and letters of its own."""
    source = convert_gguf(default_model_gguf(), Path.home() / ".cache" / "sluice")
    for file in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / file).is_file():
            shutil.copy(source / file, folder / file)
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    size = max(max(vocab.values()), *(token["id"] for token in tokenizer["added_tokens"])) + 1
    for token_id in range(size, vocab_size):
        vocab["Ġ" + "".join(chr(ord("a") + int(digit, 16)) for digit in f"{token_id:x}")] = token_id
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


def run(name: str, proc_and_base, args: argparse.Namespace) -> list[dict]:
    proc, base = proc_and_base
    try:
        asyncio.run(warm_up(base, None))
        reports = []
        for concurrency in args.concurrency:
            report = asyncio.run(level(base, None, concurrency, args, lambda text: 1))
            figures = {
                "concurrency": concurrency,
                "tokens_per_s": round(report["requests_per_s"] * args.max_tokens, 1),
                "ttft_p50_s": report["ttft_p50_s"],
                "faults": report["faults"],
            }
            print(name, json.dumps(figures), flush=True)
            reports.append(figures)
        return reports
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["gemma3_text", "qwen3"], choices=sorted(SHAPES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--requests-per-worker", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--folder", type=Path, default=Path.home() / ".cache" / "sluice" / "bench-families")
    parser.add_argument("--flags", default="", help="Sluice's flags beyond --model")
    parser.add_argument("--no-peer", action="store_true", help="Sluice alone")
    parser.add_argument("--out", type=Path, default=Path("bench/results/families.json"))
    args = parser.parse_args()
    args.ignore_eos = False
    args.folder.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[dict]]] = {}
    for model_type in args.families:
        folder = build(model_type, args.folder)
        name = SHAPES[model_type][0]
        # A context of 4096 tokens: what the workload needs, and what 2 GiB of KV cache holds for each.
        sluice = spawn(f"--model {folder} --max-model-len 4096 {args.flags}")
        results[name] = {"sluice": run(f"{name} sluice", sluice, args)}
        if not args.no_peer:
            port = server_process.free_port()
            started = peers.start("transformers", peers.Model(folder, folder), port)
            results[name]["transformers"] = run(f"{name} transformers", started, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
