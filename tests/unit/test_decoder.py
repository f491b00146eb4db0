"""The decoder layers in one native call (engine/kernels/cpu/decoder.py) give the bits of the same layers run op by
op in torch over the invariant kernels: prompts, chunks and decodes mixed, in the vector and the portable
linear variant, for each family whose layer is Llama's (biases, per-head norms and windows included), and over a
bfloat16 or float16 KV cache."""

import asyncio
import dataclasses

import pytest
import torch

from engine.kernels.cpu.decoder import BARRIER_SPIN_NS
from engine.model.teacher_forcing import teacher_forced_logits
from engine.tiny import tiny_engine, tiny_loaded
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import collect

PROMPTS = [list(range(20, 60)), [5, 9, 13], [7] * 11]


async def _outputs(loaded) -> list[list[tuple[int, float]]]:
    """Greedy tokens and their logprobs, the prompts chunked and mixed with decodes (7 tokens a step)."""
    engine = tiny_engine(loaded, max_num_batched_tokens=7, block_size=4)
    engine.start()
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
        results = await asyncio.gather(*[collect(engine, p, params) for p in PROMPTS])
    finally:
        engine.shutdown()
    return [[(lp.token_id, lp.logprob, lp.top) for chunk in chunks for lp in chunk.logprobs] for chunks in results]


def _random_norms(model) -> None:
    """Norm weights drawn, in place (both paths read the same tensors): a random model's are all 1, under which
    multiplying by the weight first or last rounds alike."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.layers:
            for module in layer.modules():
                if module.__class__.__name__.endswith("RMSNorm"):
                    module.weight.mul_(torch.rand(module.weight.shape, generator=generator) + 0.5)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
async def test_one_call_gives_the_layer_by_layer_bits(default_tokenizer, model_type):
    loaded = tiny_loaded(default_tokenizer, model_type, kernels_cache=CACHE_DIR)
    model = loaded.model
    _random_norms(model)
    decoder = model._decoder
    assert decoder is not None
    prompt = list(range(3, 60))
    fused_logits = teacher_forced_logits(tiny_engine(loaded), prompt)
    fused = await _outputs(loaded)
    model._decoder = dataclasses.replace(decoder, scalar=True)
    scalar_logits = teacher_forced_logits(tiny_engine(loaded), prompt)
    model._decoder = None
    assert torch.equal(teacher_forced_logits(tiny_engine(loaded), prompt), fused_logits)
    assert torch.equal(scalar_logits, fused_logits)
    assert await _outputs(loaded) == fused


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=str)
async def test_a_narrower_cache_rounds_alike_in_one_call_and_op_by_op(default_tokenizer, kv_dtype):
    loaded = tiny_loaded(default_tokenizer, "qwen2", kernels_cache=CACHE_DIR)
    model = loaded.model
    _random_norms(model)
    float32 = await _outputs(loaded)
    model.use_kv_dtype(kv_dtype)
    fused = await _outputs(loaded)
    assert fused != float32
    model._decoder = None
    assert await _outputs(loaded) == fused


def test_a_self_draft_takes_the_first_layers(default_tokenizer):
    loaded = tiny_loaded(default_tokenizer, "llama", kernels_cache=CACHE_DIR)
    draft = loaded.model.first_layers(1)
    assert len(draft._decoder.layers) == 1
    engine = tiny_engine(loaded)
    engine.runner.model = draft
    prompt = list(range(3, 30))
    logits = teacher_forced_logits(engine, prompt)
    draft._decoder = None
    assert torch.equal(teacher_forced_logits(engine, prompt), logits)


@pytest.mark.parametrize("model_type", ["gemma2", "olmo2", "phi3", "smollm3"])
def test_other_layers_run_op_by_op(default_tokenizer, model_type):
    assert tiny_loaded(default_tokenizer, model_type, kernels_cache=CACHE_DIR).model._decoder is None


@pytest.mark.parametrize("spin_ns", [0, BARRIER_SPIN_NS], ids=["sleeping", "spinning"])
def test_the_barriers_give_the_same_bits_asleep_or_spinning(default_tokenizer, spin_ns):
    """Three threads on this machine's two cores, so a barrier's waiters both spin and sleep (0: always sleep)."""
    loaded = tiny_loaded(default_tokenizer, "qwen3", kernels_cache=CACHE_DIR)
    model = loaded.model
    _random_norms(model)
    decoder = model._decoder
    prompts = [[11], list(range(3, 8)), list(range(3, 60))]
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        model._decoder = dataclasses.replace(decoder, barrier_spin_ns=spin_ns)
        fused = [teacher_forced_logits(tiny_engine(loaded), prompt) for prompt in prompts]
        model._decoder = None
        reference = [teacher_forced_logits(tiny_engine(loaded), prompt) for prompt in prompts]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(fused, reference))
