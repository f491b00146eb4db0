"""A mixture-of-experts model against the dense model of its active size, on the engine (bench/engine.py's
raw forward and engine figures), random weights.

    python bench/moe.py                                  # 1 and 32 streams, Sluice's defaults
    python bench/moe.py --flags "--dtype bfloat16"       # torch's kernels instead of the invariant ones

The mixture of experts is Qwen3-30B-A3B's routing scaled down to fit a small machine: its 128 experts and
top-8, with hidden size, expert width and layers cut (`--hidden`, `--expert-width`, `--layers`). The dense
model is Qwen3 of the same shape whose MLP is as wide as the 8 experts a token runs together, so both
compute the same multiply-adds per token; the MoE reads up to 16 times the expert weights (128 / 8) once
its tokens spread over the experts. Each model is built once under `--folder` (SmolLM2's tokenizer) and
run in a process of its own, one after the other.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.model_files import convert_gguf, default_model_gguf  # noqa: E402

# Qwen3-30B-A3B's routing.
NUM_EXPERTS = 128
TOP_K = 8


def shapes(args: argparse.Namespace) -> dict[str, dict]:
    """The two models' configurations: model_type and the config's fields."""
    common = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return {
        "moe": dict(
            model_type="qwen3_moe",
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=args.expert_width,
            norm_topk_prob=True,
            **common,
        ),
        "dense": dict(model_type="qwen3", intermediate_size=TOP_K * args.expert_width, **common),
    }


def build(folder: Path, fields: dict) -> None:
    """A random-weight model folder of these config fields, once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (folder / "config.json").exists():
        return
    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(default_model_gguf(), Path.home() / ".cache" / "sluice"))
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=len(tokenizer), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flags", default="", help="Sluice flags for both models (dtype, ...)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-worker", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-width", type=int, default=192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--folder", type=Path, default=Path.home() / ".cache" / "sluice" / "bench-moe")
    parser.add_argument("--out", default="bench/results/moe.json")
    args = parser.parse_args()

    results = {}
    for name, fields in shapes(args).items():
        tag = f"{name}-h{args.hidden}-w{args.expert_width}-l{args.layers}"
        folder = args.folder / tag
        build(folder, fields)
        out = Path(args.out).with_suffix(f".{name}.json")
        command = [
            sys.executable,
            str(Path(__file__).parent / "engine.py"),
            "--flags",
            f"--model {folder} {args.flags}",
            "--concurrency",
            *map(str, args.concurrency),
            "--max-tokens",
            str(args.max_tokens),
            "--requests-per-worker",
            str(args.requests_per_worker),
            "--out",
            str(out),
        ]
        subprocess.run(command, check=True)
        results[name] = json.loads(out.read_text())

    print("\n| streams | model | raw forward tok/s | engine tok/s |")
    print("|---|---|---|---|")
    for concurrency in args.concurrency:
        for name, by_level in results.items():
            r = by_level[str(concurrency)]
            print(f"| {concurrency} | {name} | {r['raw_tokens_per_s']} | {r['engine_output_tokens_per_s']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
