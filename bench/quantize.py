"""--quantize against the weights as loaded: accuracy and decode speed on the default model (or --model).

    python bench/quantize.py                          # none, q8_0, q4_1 on bench/texts/river.txt
    python bench/quantize.py --model DIR --batches 1 8

- Accuracy: the text's tokens teacher-forced through the paged forward; how often each quantized model picks
  the unquantized model's top token, and each model's perplexity on the text.
- Speed: the raw paged forward (bench/engine.py's `raw`) decoding a batch, per form.

The default model's weights ship as Q4_1 blocks (its head as Q8_0), so on it q4_1 requantizes values that
already are 4-bit: its figures bound what quantizing costs a model that ships in float32 or bf16 from below.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic_settings import CliApp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.settings import Settings  # noqa: E402
from app.state import build_state  # noqa: E402
from bench.engine import raw_forward  # noqa: E402
from engine.model.host_memory import keep_freed_memory  # noqa: E402
from engine.model.teacher_forcing import agreement_and_perplexity, teacher_forced_logits  # noqa: E402

TEXT = Path(__file__).parent / "texts" / "river.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8], help="none: accuracy only")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    keep_freed_memory()
    reference = None
    for form in ("none", "q8_0", "q4_1"):
        cli = ["--quantize", form] + (["--model", args.model] if args.model else [])
        state = build_state(CliApp.run(Settings, cli_args=cli))
        tokens = state.loaded.tokenizer(args.text.read_text()).input_ids[:1024]
        logits = teacher_forced_logits(state.engine, tokens)
        reference = logits if reference is None else reference
        agreement, perplexity = agreement_and_perplexity(logits, reference, tokens)
        speeds = ", ".join(f"batch {b}: {raw_forward(state, b, args.steps):.1f} tok/s" for b in args.batches)
        print(
            f"{form}: top-1 agreement {agreement:.3f} over {len(tokens)} tokens, perplexity {perplexity:.2f}; {speeds}"
        )


if __name__ == "__main__":
    main()
