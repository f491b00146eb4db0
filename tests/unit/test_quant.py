"""Int4 weight-only layers: exact on 4-bit weights, wired into every projection, used only for small steps."""

import asyncio

import pytest
import torch

from engine.model.loader import resolve_int4_max_tokens
from engine.model.quant import GROUP_SIZE, Int4Weight, int4_copies
from engine.tiny import tiny_engine, tiny_loaded
from engine.types import SamplingParams
from tests.unit.helpers import collect, tokens_of


def snap_to_4_bits(weight: torch.Tensor) -> torch.Tensor:
    """What a GGUF Q4_1 tensor dequantizes to: 16 levels per group of 32, w = d * q + m."""
    groups = weight.reshape(weight.shape[0], -1, GROUP_SIZE)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low) / 15
    return (((groups - low) / scale).round() * scale + low).reshape(weight.shape)


def test_int4_reproduces_weights_that_are_already_4_bit():
    torch.manual_seed(0)
    weight = snap_to_4_bits(torch.randn(96, 128))
    x = torch.randn(5, 128)
    assert torch.allclose(Int4Weight.quantize(weight, torch.float32)(x), x @ weight.t(), atol=1e-4)


def test_int4_of_arbitrary_weights_is_close_not_equal():
    torch.manual_seed(0)
    weight = torch.randn(96, 128)
    x = torch.randn(5, 128)
    reference = x @ weight.t()
    # 16 levels per group of Gaussian weights: about 10% relative error, as 4-bit quantization gives.
    relative = (Int4Weight.quantize(weight, torch.float32)(x) - reference).norm() / reference.norm()
    assert 0.01 < relative < 0.15


@pytest.fixture
def four_bit_loaded(default_tokenizer):
    loaded = tiny_loaded(default_tokenizer)
    with torch.no_grad():
        modules = [m for layer in loaded.model.layers for m in layer.modules()] + [loaded.model.lm_head]
        for module in modules:
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(snap_to_4_bits(module.weight))
    return loaded


async def greedy_outputs(loaded, prompts, **overrides):
    engine = tiny_engine(loaded, **overrides)
    engine.start()
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0)
        return [tokens_of(c) for c in await asyncio.gather(*[collect(engine, p, params) for p in prompts])]
    finally:
        engine.shutdown()


async def test_int4_steps_decode_exactly_what_full_precision_does_on_4_bit_weights(four_bit_loaded):
    prompts = [[5, 9, 13], list(range(20, 60)), [7] * 11]
    model = four_bit_loaded.model
    expected = await greedy_outputs(four_bit_loaded, prompts)
    hf_modules = [m for layer in model.layers for m in layer.modules()] + [model.lm_head]
    copies = {m: w for module in hf_modules for m, w in int4_copies(module, torch.float32).items()}
    assert len(copies) == 7 * model.num_layers + 1  # q, k, v, o, gate, up, down per layer, and the head
    model.use_int4(copies, max_tokens=1 << 20)  # every decode step
    try:
        assert await greedy_outputs(four_bit_loaded, prompts) == expected
    finally:
        model.use_int4({}, 0)


@pytest.mark.parametrize("max_tokens, expected_sizes", [(1, {1}), (1 << 20, {1, 2})])
async def test_int4_runs_decode_steps_within_the_threshold_and_never_prompt_tokens(
    four_bit_loaded, max_tokens, expected_sizes
):
    model = four_bit_loaded.model
    q_proj = model.layers[0].self_attn.q_proj
    quantized = Int4Weight.quantize(q_proj.weight, torch.float32)
    step_sizes = []

    def spy(x):
        step_sizes.append(x.shape[0])
        return quantized(x)

    model.use_int4({q_proj: spy}, max_tokens=max_tokens)
    engine = tiny_engine(four_bit_loaded, max_num_batched_tokens=3)
    engine.start()
    try:
        # Prompt steps (3 tokens each) never use int4; decode steps are 2 tokens, then 1.
        await asyncio.gather(
            collect(engine, [1, 2, 3], SamplingParams(max_tokens=16, temperature=0.0)),
            collect(engine, [4, 5, 6], SamplingParams(max_tokens=8, temperature=0.0)),
        )
    finally:
        engine.shutdown()
        model.use_int4({}, 0)
    assert set(step_sizes) == expected_sizes


def test_int4_is_on_by_default_only_for_the_embedded_model_on_an_avx512_cpu(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert resolve_int4_max_tokens(None, default_model=True, device=cpu) == 16
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert resolve_int4_max_tokens(None, default_model=True, device=cpu) == 0
    assert resolve_int4_max_tokens(8, default_model=True, device=cpu) == 8
    assert resolve_int4_max_tokens(None, default_model=False, device=cpu) == 0
    assert resolve_int4_max_tokens(3, default_model=False, device=cpu) == 3
    assert resolve_int4_max_tokens(None, default_model=True, device=cuda) == 0
