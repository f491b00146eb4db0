"""The runner's wiring of the GPU's paged attention kernels: an engine attending through them gives
the tokens of the SDPA path. Here on the CPU, through Triton's interpreter, where CUDA is not."""

import asyncio

import pytest
import torch

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET: the kernels run in Triton's interpreter.
pytest.importorskip("triton", reason="the GPU's attention kernels are written in Triton")
pytestmark = pytest.mark.interpreter

from engine.config import SpeculativeConfig  # noqa: E402
from engine.model.attention.triton_paged import gpu_attention  # noqa: E402
from engine.tiny import tiny_engine, tiny_loaded  # noqa: E402
from engine.types import SamplingParams  # noqa: E402
from tests.unit.helpers import collect  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels(model):
    """gpu_attention as it would be on a CUDA device, for the model's heads and 16-token blocks."""
    return gpu_attention(torch.device("cuda"), 16, model.num_heads, model.num_kv_heads, model.head_dim)


async def _tokens(loaded, kernels, prompts, params, **overrides):
    engine = tiny_engine(loaded, block_size=16, **overrides)
    engine.runner.gpu_attention = kernels
    # On CUDA the engine has captured decode graphs (through the kernels): this compares eager steps.
    engine.runner.graphs = None
    engine.start()
    try:
        results = await asyncio.gather(*[collect(engine, p, params) for p in prompts])
        stats = engine.stats
    finally:
        engine.shutdown()
    return [[t for chunk in chunks for t in chunk.token_ids] for chunks in results], stats


async def test_an_engine_through_the_kernels_gives_the_tokens_of_the_sdpa_path(default_tokenizer):
    """Ragged decodes whose contexts cross cache blocks; prompts longer than a step's 32 tokens,
    prefilled in chunks after their earlier chunks are cached; prompts sharing a 40-token prefix, so
    later ones start after a prefix-cache hit."""
    loaded = tiny_loaded(default_tokenizer, device=DEVICE)
    kernels = _kernels(loaded.model)
    assert kernels is not None
    shared = list(range(300, 340))
    prompts = [list(range(20, 95)), [5, 9, 13], [7] * 15, shared + [1, 2, 3], shared + list(range(60, 81)), shared]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    through_sdpa, sdpa_stats = await _tokens(loaded, None, prompts, params)
    through_kernels, kernel_stats = await _tokens(loaded, kernels, prompts, params)
    assert all(len(tokens) == 24 for tokens in through_sdpa)
    assert kernel_stats.num_prefix_hit_tokens == sdpa_stats.num_prefix_hit_tokens > 0
    assert through_kernels == through_sdpa


async def test_verification_steps_through_the_kernels_give_the_tokens_of_the_sdpa_path(default_tokenizer):
    """With n-gram speculation a request verifies its proposals in a multi-token segment, which the
    prefill kernel computes."""
    loaded = tiny_loaded(default_tokenizer, repetitive=True, device=DEVICE)
    prompts = [[11, 12, 13] * 4, [40, 41] * 6, list(range(200, 230))]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ngram = SpeculativeConfig("ngram", num_tokens=4)

    through_sdpa, _ = await _tokens(loaded, None, prompts, params, speculative=ngram)
    through_kernels, stats = await _tokens(loaded, _kernels(loaded.model), prompts, params, speculative=ngram)
    assert stats.num_draft_tokens > 0
    assert through_kernels == through_sdpa
