"""A stand-in accelerator for the host-cost benchmarks: the model's forward returns fixed logits (and
the block maxima the batch-invariant head gives with them) after a fixed time, sleeping with the GIL
released, as a GPU computes a step while the host's threads run Python.

    python bench/stub_accelerator.py --step-ms 4 --model FOLDER ...   # a Sluice server on the stub
    python bench/stub_accelerator.py --step-ms 20 cluster --replicas 2 --model FOLDER ...   # every replica on it

With it, what limits a step is what it limits on a GPU host: the engine thread's Python and the event
loop's, sharing one GIL (`python bench/hostcost.py --stub-step-ms 4`). Every row's argmax is the same
ordinary word, so every step streams one text chunk per request.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

_CHECKOUT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(_CHECKOUT))

from engine.model.causal_lm import HeadOutput, PagedCausalLM  # noqa: E402
from engine.sampling.sampler import BLOCK  # noqa: E402

# " the" in the default model's tokenizer: a word, so every chunk carries text.
WORD_TOKEN = 260
_PEAK = 50.0


def install(step_ms: float) -> None:
    """Every PagedCausalLM's forward in this process becomes the stub."""
    cache: dict[tuple[int, int], HeadOutput] = {}

    def forward(
        self: PagedCausalLM, input_ids, positions, meta, kv_cache, logits_indices, image_rows=None, rope_positions=None
    ):
        rows, vocab = logits_indices.shape[0], self.vocab_size
        output = cache.get((rows, vocab))
        if output is None:
            logits = torch.zeros(rows, vocab)
            # Far above the rest: sampled at any temperature too (bench/serve.py samples at 0.7).
            logits[:, WORD_TOKEN] = _PEAK
            block_max = torch.zeros(rows, (vocab + BLOCK - 1) // BLOCK)
            block_max[:, WORD_TOKEN // BLOCK] = _PEAK
            output = cache[(rows, vocab)] = HeadOutput(logits, block_max)
        time.sleep(step_ms / 1000)
        return output

    PagedCausalLM.forward = forward


_STEP_MS_VARIABLE = "SLUICE_STUB_STEP_MS"


def install_from_environment() -> None:
    """Ray's worker set-up hook of a stubbed cluster: the stub in every process of the cluster (the engine
    replicas' forwards; the others have none to run)."""
    install(float(os.environ[_STEP_MS_VARIABLE]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, required=True)
    args, server_flags = parser.parse_known_args()
    if server_flags[:1] == ["cluster"]:
        from app.cluster.serve import main as cluster

        cluster(
            server_flags[1:],
            runtime_env={
                "worker_process_setup_hook": "bench.stub_accelerator.install_from_environment",
                # The hook is imported before Ray puts the driver's directory on a worker's path.
                "env_vars": {_STEP_MS_VARIABLE: str(args.step_ms), "PYTHONPATH": str(_CHECKOUT)},
            },
        )
        return
    install(args.step_ms)
    from app.__main__ import main as serve

    sys.argv = [sys.argv[0], *server_flags]
    serve()


if __name__ == "__main__":
    main()
