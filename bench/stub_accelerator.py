"""A stand-in accelerator for the host-cost benchmarks: the model's forward returns fixed logits (and
the block maxima the batch-invariant head gives with them) after a fixed time, sleeping with the GIL
released, as a GPU computes a step while the host's threads run Python.

    python bench/stub_accelerator.py --step-ms 4 --model FOLDER ...   # a Sluice server on the stub

With it, what limits a step is what it limits on a GPU host: the engine thread's Python and the event
loop's, sharing one GIL (`python bench/hostcost.py --stub-step-ms 4`). Every row's argmax is the same
ordinary word, so every step streams one text chunk per request.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.causal_lm import HeadOutput, PagedCausalLM  # noqa: E402
from engine.sampling.sampler import BLOCK  # noqa: E402

# " the" in the default model's tokenizer: a word, so every chunk carries text.
WORD_TOKEN = 260


def install(step_ms: float) -> None:
    """Every PagedCausalLM's forward in this process becomes the stub."""
    cache: dict[tuple[int, int], HeadOutput] = {}

    def forward(self: PagedCausalLM, input_ids, positions, meta, kv_cache, logits_indices, allow_int4=True):
        rows, vocab = logits_indices.shape[0], self.vocab_size
        output = cache.get((rows, vocab))
        if output is None:
            logits = torch.zeros(rows, vocab)
            logits[:, WORD_TOKEN] = 1.0
            block_max = torch.zeros(rows, (vocab + BLOCK - 1) // BLOCK)
            block_max[:, WORD_TOKEN // BLOCK] = 1.0
            output = cache[(rows, vocab)] = HeadOutput(logits, block_max)
        time.sleep(step_ms / 1000)
        return output

    PagedCausalLM.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, required=True)
    args, server_flags = parser.parse_known_args()
    install(args.step_ms)
    from app.__main__ import main as serve

    sys.argv = [sys.argv[0], *server_flags]
    serve()


if __name__ == "__main__":
    main()
