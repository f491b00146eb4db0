"""--quantize: every linear layer in GGUF's blocks as gguf's own quantizer writes them, outputs still
batch-invariant, accuracy bounded against the unquantized model, and refused where its kernels cannot run."""

import asyncio

import pytest
import torch
from gguf import GGMLQuantizationType, dequantize
from gguf import quantize as gguf_quantize

from engine.kernels.cpu.invariant import WeightForm
from engine.model.loader import load_model
from engine.model.teacher_forcing import agreement_and_perplexity, teacher_forced_logits
from engine.tiny import tiny_engine, tiny_hf_model, tiny_loaded
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import collect

KINDS = {WeightForm.Q8_0: GGMLQuantizationType.Q8_0, WeightForm.Q4_1: GGMLQuantizationType.Q4_1}
# A fixed token sequence the tiny model is teacher-forced through.
TEXT = [(i * 37 + 11) % 512 for i in range(200)]


@pytest.mark.parametrize("quantize", ["q8_0", "q4_1"])
def test_every_layer_holds_the_quantizers_blocks_and_the_head_q8_0(default_tokenizer, quantize):
    loaded = tiny_loaded(default_tokenizer, kernels_cache=CACHE_DIR, quantize=quantize)
    reference = tiny_hf_model()  # same seed, same weights
    layer_form = WeightForm.Q8_0 if quantize == "q8_0" else WeightForm.Q4_1
    modules = dict(reference.named_modules())
    for name, module in loaded.model.layers[0].named_modules(prefix="model.layers.0"):
        if isinstance(module, torch.nn.Linear):
            packed = loaded.model._packed[module]
            assert packed.form == layer_form, name
            weight = modules[name].weight.detach().numpy()
            expected = dequantize(gguf_quantize(weight, KINDS[layer_form]), KINDS[layer_form])
            assert torch.equal(packed.unpacked(), torch.from_numpy(expected)), name
    assert loaded.model._packed[loaded.model.lm_head].form == WeightForm.Q8_0


@pytest.mark.parametrize("quantize", ["q8_0", "q4_1"])
async def test_quantized_outputs_depend_on_the_request_alone(default_tokenizer, quantize):
    loaded = tiny_loaded(default_tokenizer, kernels_cache=CACHE_DIR, quantize=quantize)
    prompts = [list(range(20, 60)), [5, 9, 13], [7] * 11]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0)

    async def run(prompts, **config):
        engine = tiny_engine(loaded, **config)
        engine.start()
        try:
            results = await asyncio.gather(*[collect(engine, p, params) for p in prompts])
        finally:
            engine.shutdown()
        return [[(t, lp) for c in chunks for t, lp in zip(c.token_ids, c.logprobs or [])] for chunks in results]

    alone = [(await run([p]))[0] for p in prompts]
    assert await run(prompts) == alone
    assert await run(prompts, max_num_batched_tokens=5) == alone


def test_accuracy_against_the_unquantized_model_stays_within_bounds(default_tokenizer):
    """Bounds a little under what was measured (the tiny random model's logits are nearly flat, so its top
    token is fragile: these catch a broken quantizer or kernel, not a fine regression)."""
    reference = teacher_forced_logits(tiny_engine(tiny_loaded(default_tokenizer, kernels_cache=CACHE_DIR)), TEXT)
    _, reference_perplexity = agreement_and_perplexity(reference, reference, TEXT)
    for quantize, min_agreement in (("q8_0", 0.9), ("q4_1", 0.35)):
        logits = teacher_forced_logits(
            tiny_engine(tiny_loaded(default_tokenizer, kernels_cache=CACHE_DIR, quantize=quantize)), TEXT
        )
        agreement, perplexity = agreement_and_perplexity(logits, reference, TEXT)
        assert agreement >= min_agreement, quantize
        assert abs(perplexity / reference_perplexity - 1) < 0.02, quantize


def test_quantize_without_the_batch_invariant_kernels_is_refused(tmp_path, default_tokenizer):
    tiny_hf_model().save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--quantize q8_0 needs the batch-invariant kernels"):
        load_model(str(tmp_path), tmp_path / "cache", "cpu", "auto", False, quantize="q8_0")
