"""The paged ragged forward must reproduce Hugging Face's own greedy decoding."""

import asyncio

import pytest
import torch

from engine.types import SamplingParams
from tests.unit.helpers import collect, tiny_engine, tiny_hf_model, tiny_loaded, tokens_of

PROMPTS = [[5, 9, 13], list(range(20, 60)), [7] * 11, list(range(100, 103))]


def hf_greedy(hf_model, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kernels", [True, False], ids=["invariant-kernels", "torch-kernels"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
async def test_engine_greedy_matches_hf_generate_in_a_mixed_batch(default_tokenizer, model_type, kernels):
    loaded = tiny_loaded(default_tokenizer, model_type, kernels=kernels)
    reference = tiny_hf_model(model_type)  # same seed, same weights
    expected = [hf_greedy(reference, p, 12) for p in PROMPTS]
    # A budget of 7 tokens and blocks of 4 force chunked prefill across block edges,
    # mixed with decodes of other requests in the same steps.
    engine = tiny_engine(loaded, max_num_batched_tokens=7, block_size=4)
    engine.start()
    try:
        results = await asyncio.gather(
            *[collect(engine, p, SamplingParams(max_tokens=12, temperature=0.0)) for p in PROMPTS]
        )
    finally:
        engine.shutdown()
    assert [tokens_of(r) for r in results] == expected
