"""Every model family Sluice serves, on a tiny random model it builds: token for token Hugging Face's own
greedy `generate` in float32 (and its logprobs, to float32's rounding), on torch's kernels and on the
batch-invariant ones, and on the latter the same tokens and logprobs alone, in a mixed batch, chunked, and
from the prefix cache."""

import asyncio

import pytest

from engine.model.families import SUPPORTED_MODEL_TYPES
from engine.tiny import FAMILY_CONFIGS, tiny_engine, tiny_hf_model, tiny_loaded
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import collect, hf_greedy_logprobs, tokens_of

PROMPTS = [list(range(20, 60)), [5, 9, 13], [7] * 11]
NEW_TOKENS = 32
FAMILIES = sorted(FAMILY_CONFIGS)


def test_every_supported_model_type_is_tested_here():
    assert set(FAMILIES) == SUPPORTED_MODEL_TYPES


async def _run(loaded, prompts, **config):
    engine = tiny_engine(loaded, **config)
    engine.start()
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0)
        results = await asyncio.gather(*[collect(engine, p, params) for p in prompts])
    finally:
        engine.shutdown()
    return results


@pytest.mark.parametrize("kernels", [True, False], ids=["invariant-kernels", "torch-kernels"])
@pytest.mark.parametrize("model_type", FAMILIES)
async def test_greedy_matches_hf_generate_in_a_chunked_mixed_batch(default_tokenizer, model_type, kernels):
    loaded = tiny_loaded(default_tokenizer, model_type, kernels_cache=CACHE_DIR if kernels else None)
    reference = tiny_hf_model(model_type)  # same seed, same weights
    expected = [hf_greedy_logprobs(reference, p, NEW_TOKENS) for p in PROMPTS]
    # A budget of 7 tokens and blocks of 4 force chunked prefill across block edges, mixed with decodes.
    results = await _run(loaded, PROMPTS, max_num_batched_tokens=7, block_size=4)
    assert [tokens_of(r) for r in results] == [[token for token, _ in e] for e in expected]
    # A change of the logits that keeps their order (a scaling, a soft cap) shows in the logprobs alone.
    logprobs = [[lp.logprob for chunk in chunks for lp in chunk.logprobs] for chunks in results]
    assert logprobs == [pytest.approx([lp for _, lp in e], abs=1e-4) for e in expected]


def _tokens_and_logprobs(results):
    return [[(t, lp) for chunk in chunks for t, lp in zip(chunk.token_ids, chunk.logprobs or [])] for chunks in results]


@pytest.mark.parametrize("model_type", FAMILIES)
async def test_outputs_depend_on_the_request_alone(default_tokenizer, model_type):
    loaded = tiny_loaded(default_tokenizer, model_type, kernels_cache=CACHE_DIR)
    alone = [_tokens_and_logprobs(await _run(loaded, [p]))[0] for p in PROMPTS]
    assert all(len(output) == NEW_TOKENS for output in alone)
    assert _tokens_and_logprobs(await _run(loaded, PROMPTS)) == alone
    assert _tokens_and_logprobs(await _run(loaded, PROMPTS, max_num_batched_tokens=5)) == alone
    engine = tiny_engine(loaded)
    engine.start()
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0)
        for prompts, expected in ((PROMPTS, alone), (PROMPTS[::-1], alone[::-1])):
            results = await asyncio.gather(*[collect(engine, p, params) for p in prompts])
            assert _tokens_and_logprobs(results) == expected
        assert engine.block_manager.num_prefix_hits > 0
    finally:
        engine.shutdown()
