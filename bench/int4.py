"""int4 against full precision on the default model: decode speed per batch size, and head accuracy.

    python bench/int4.py                      # batches 1 2 4 8 16 32
    python bench/int4.py --batches 1 8 --text README.md

- Speed: the raw paged forward (bench/engine.py's `raw`) decoding a batch, with the int4 copies
  of the decoder layers on every step and then off, alternated in one process.
- Head accuracy: over the first 1024 tokens of `--text`, how often a bf16 and an int4 copy of the
  output head pick the same top token as the float32 head (teacher-forced, float32 hidden states),
  and their mean KL divergence from it. This is why the head stays out of int4.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from pydantic_settings import CliApp
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.settings import Settings  # noqa: E402
from app.state import build_state  # noqa: E402
from bench.engine import raw_forward  # noqa: E402
from bench.serve import default_model  # noqa: E402
from engine.model.host_memory import keep_freed_memory  # noqa: E402
from engine.model.quant import Int4Weight  # noqa: E402


def speed(batches: list[int], steps: int) -> None:
    keep_freed_memory()
    state = build_state(CliApp.run(Settings, cli_args=["--int4-max-tokens", str(1 << 20)]))
    model = state.loaded.model
    threshold = model.int4_max_tokens
    for batch in batches:
        model.int4_max_tokens = threshold
        quantized = raw_forward(state, batch, steps)
        model.int4_max_tokens = 0
        full = raw_forward(state, batch, steps)
        print(f"batch {batch}: int4 {quantized:.1f} tok/s, {model.dtype} {full:.1f} tok/s, {quantized / full:.2f}x")


def head_accuracy(text: str) -> None:
    path = default_model().folder
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :1024]
    hidden = model.model(ids).last_hidden_state[0]
    weight = model.lm_head.weight
    reference = (hidden @ weight.t()).log_softmax(-1)
    heads = {
        "bf16": (hidden.bfloat16() @ weight.bfloat16().t()).float(),
        "int4": Int4Weight.quantize(weight, torch.float32)(hidden),
    }
    for name, logits in heads.items():
        agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        kl = (reference.exp() * (reference - logits.log_softmax(-1))).sum(-1).mean().item()
        print(f"{name} head: top-1 agreement with float32 {agreement:.1%} over {ids.shape[1]} tokens, KL {kl:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--text", default=str(Path(__file__).resolve().parent.parent / "README.md"))
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    speed(args.batches, args.steps)
    head_accuracy(Path(args.text).read_text()[:6000])


if __name__ == "__main__":
    main()
