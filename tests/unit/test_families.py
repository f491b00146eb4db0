"""Every model family Sluice serves, on a tiny random model it builds: token for token Hugging Face's own
greedy `generate` in float32 (and its logprobs, to float32's rounding), on torch's kernels, on the CPU's
batch-invariant ones and on the GPU's (in Triton's interpreter where there is no CUDA), and on the
batch-invariant ones the same tokens and logprobs alone, in a mixed batch, chunked, and from the prefix
cache."""

import asyncio

import pytest
import torch

from engine.engine import Engine
from engine.model.attention.triton_paged import gpu_attention
from engine.model.families import SUPPORTED_MODEL_TYPES
from engine.model.invariant_kernels import use_gpu_invariant_kernels
from engine.model.loader import LoadedModel
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


def _on_gpu_kernels(tokenizer, model_type: str) -> LoadedModel:
    """The family's tiny float32 model with the GPU's kernels set up as loading it on a CUDA device sets
    them up; without CUDA on CPU tensors, for the interpreter (whose tl.dot multiplies bfloat16 as integers)."""
    pytest.importorskip("triton", reason="the GPU's kernels are written in Triton")
    loaded = tiny_loaded(tokenizer, model_type, device="cuda" if torch.cuda.is_available() else "cpu")
    use_gpu_invariant_kernels(loaded.model)
    assert loaded.model.batch_invariant
    return loaded


def _gpu_engine(loaded: LoadedModel, **config) -> Engine:
    """An engine as on a CUDA device: overlapped steps, the paged Triton attention (blocks of 16, the
    smallest it takes), and decode steps replayed from static buffers padded to their bucket where the family
    is graph-capturable (run eagerly without CUDA, as --enforce-eager runs them)."""
    engine = tiny_engine(loaded, **{"block_size": 16, **config, "overlap_steps": True})
    model, runner = loaded.model, engine.runner
    if runner.gpu_attention is None:
        runner.gpu_attention = gpu_attention(
            torch.device("cuda"), runner.block_size, model.num_heads, model.num_kv_heads, model.head_dim
        )
        runner.capture_decode_graphs(engine.config.max_num_seqs, engine.config.max_model_len, eager=True)
    assert runner.gpu_attention is not None and (runner.graphs is not None) == model.family.graph_capturable
    return engine


async def _gather(engine: Engine, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0)
    return await asyncio.gather(*[collect(engine, p, params) for p in prompts])


# A greedy request's first tokens are those of a shorter one: the runs alone and from the cache stop there,
# each interpreted step costing about half a second of CPU.
GPU_INVARIANCE_TOKENS = 8


@pytest.mark.interpreter
@pytest.mark.parametrize("model_type", FAMILIES)
async def test_on_the_gpu_kernels_greedy_matches_hf_generate_and_depends_on_the_request_alone(
    default_tokenizer, model_type
):
    """The GPU's path (its batch-invariant linear layers, norms and experts, the fused kernels, the paged
    Triton attention, replayed decode steps): Hugging Face's tokens and logprobs in a chunked mixed batch,
    and the batch's first tokens to the last bit alone and with a prompt read from the prefix cache."""
    loaded = _on_gpu_kernels(default_tokenizer, model_type)
    reference = tiny_hf_model(model_type)  # same seed, same weights
    expected = [hf_greedy_logprobs(reference, p, NEW_TOKENS) for p in PROMPTS]
    # A budget of 7 tokens forces chunked prefill across the blocks' edges, mixed with decodes.
    engine = _gpu_engine(loaded, max_num_batched_tokens=7)
    engine.start()
    try:
        batched = await _gather(engine, PROMPTS, NEW_TOKENS)
    finally:
        engine.shutdown()
    assert [tokens_of(r) for r in batched] == [[token for token, _ in e] for e in expected]
    logprobs = [[lp.logprob for chunk in chunks for lp in chunk.logprobs] for chunks in batched]
    assert logprobs == [pytest.approx([lp for _, lp in e], abs=1e-4) for e in expected]

    first = [output[:GPU_INVARIANCE_TOKENS] for output in _tokens_and_logprobs(batched)]
    engine = _gpu_engine(loaded)
    engine.start()
    try:
        alone = [_tokens_and_logprobs(await _gather(engine, [p], GPU_INVARIANCE_TOKENS))[0] for p in PROMPTS]
        assert alone == first
        # The longest prompt's blocks are cached now: read from there, in a batch of another order.
        cached = await _gather(engine, PROMPTS[::-1], GPU_INVARIANCE_TOKENS)
        assert _tokens_and_logprobs(cached) == first[::-1]
        assert engine.block_manager.num_prefix_hits > 0
    finally:
        engine.shutdown()
