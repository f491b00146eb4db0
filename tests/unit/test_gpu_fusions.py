"""The GPU's fused kernels (stacked projections, the residual add in the norm, SiLU's gated product, the
rotary embedding with the cache's write) against the unfused ops they replace: the same bits where both
run the same arithmetic, and an engine on them the unfused engine's tokens and logprobs. On a machine
without CUDA they run in Triton's interpreter; without Triton the file skips."""

import asyncio
import dataclasses

import pytest
import torch

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET: the kernels run in Triton's interpreter.
pytest.importorskip("triton", reason="the GPU's fused kernels are written in Triton")
pytestmark = pytest.mark.interpreter

from engine.kernels.gpu.activation import silu_and_mul  # noqa: E402
from engine.kernels.gpu.invariant import InvariantLinear, InvariantLinears, InvariantRMSNorm  # noqa: E402
from engine.kernels.gpu.rotary import rotary_and_store  # noqa: E402
from engine.model.attention.triton_paged import gpu_attention  # noqa: E402
from engine.model.causal_lm import PagedCausalLM  # noqa: E402
from engine.model.invariant_kernels import use_gpu_invariant_kernels  # noqa: E402
from engine.model.layers import NO_FUSIONS, Rotary  # noqa: E402
from engine.tiny import FAMILY_CONFIGS, tiny_engine, tiny_hf_model, tiny_loaded  # noqa: E402
from engine.types import SamplingParams  # noqa: E402
from tests.unit.helpers import collect, hf_greedy_logprobs  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# Triton's interpreter multiplies bfloat16 operands of tl.dot as their bits' integers: bfloat16 dots run on CUDA only.
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="CUDA only"))]


def _randn(*shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_projections_give_each_layer_s_own_bits_and_share_its_memory(dtype, bias):
    torch.manual_seed(0)
    layers = tuple(torch.nn.Linear(96, width, bias=bias).to(DEVICE, dtype) for width in (64, 32, 32))
    x = _randn(37, 96, dtype=dtype, seed=1)
    alone = [InvariantLinear.of(layer)(x) for layer in layers]
    stacked = InvariantLinears.of(layers)
    for part, expected in zip(stacked(x), alone, strict=True):
        assert torch.equal(part, expected)
    # The layers' own parameters are views of the stack: stacking costs no memory.
    base = stacked.linear.weight.untyped_storage().data_ptr()
    assert all(layer.weight.untyped_storage().data_ptr() == base for layer in layers)
    assert InvariantLinears.fusable(layers)
    assert not InvariantLinears.fusable((layers[0], torch.nn.Linear(95, 8).to(DEVICE, dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norm_adding_the_residual_gives_the_sum_and_the_norm_of_the_unfused_ops(dtype):
    norm = InvariantRMSNorm(1 + 0.1 * _randn(576, dtype=dtype, seed=2), 1e-5)
    residual, delta = _randn(21, 576, dtype=dtype, seed=3), _randn(21, 576, dtype=dtype, seed=4)
    total, normed = norm.add(residual, delta)
    assert torch.equal(total, residual + delta)
    assert torch.equal(normed, norm(residual + delta))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_torch_s_silu_times_up(dtype):
    # Gate and up as the stacked gate/up projection gives them: views with the stack's row stride.
    stacked = 4 * _randn(19, 2 * 1500, dtype=dtype, seed=5)
    gate, up = stacked.split(1500, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    if CUDA:
        # torch's CUDA kernel: the same float32 arithmetic, libdevice's exp and a correctly rounded division.
        assert torch.equal(silu_and_mul(gate, up), expected)
    else:
        # On a CPU torch's exp is a vectorized approximation: an ulp or so apart.
        torch.testing.assert_close(silu_and_mul(gate, up), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
def test_rotary_and_store_rotates_as_torch_and_writes_the_cache_at_the_slots(dtype, rotary_dim):
    num_tokens, heads, kv_heads, head_dim = 9, 6, 2, 64
    # q, k, v as the stacked q/k/v projection gives them: views with the stack's row stride.
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=6)
    q, k, v = (
        part.view(num_tokens, -1, head_dim)
        for part in qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    )
    positions = torch.arange(3, 3 + num_tokens, device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=DEVICE).float() / rotary_dim))
    angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)
    rotary = Rotary(angles.cos().to(dtype).unsqueeze(1), angles.sin().to(dtype).unsqueeze(1))
    slots = torch.tensor([40, 3, 17, 8, 9, 30, 31, 0, 22], device=DEVICE)
    k_cache, v_cache = (torch.zeros(48, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
    q_rotated = rotary_and_store(q, k, v, rotary.cos, rotary.sin, k_cache, v_cache, slots)
    assert torch.equal(q_rotated, rotary.apply(q))
    expected_k, expected_v = (torch.zeros_like(k_cache) for _ in range(2))
    expected_k.index_copy_(0, slots, rotary.apply(k))
    expected_v.index_copy_(0, slots, v)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


async def _greedy(loaded, prompts, new_tokens):
    engine = tiny_engine(loaded, block_size=16, max_num_batched_tokens=24)
    model = loaded.model
    # The paged Triton attention, as on a CUDA device (it reads keys from the cache alone, so the rotary
    # embedding is fused with the cache's write).
    engine.runner.gpu_attention = gpu_attention(
        torch.device("cuda"), 16, model.num_heads, model.num_kv_heads, model.head_dim
    )
    engine.start()
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, logprobs=0)
        results = await asyncio.gather(*[collect(engine, prompt, params) for prompt in prompts])
    finally:
        engine.shutdown()
    return [[(t, lp.logprob) for c in chunks for t, lp in zip(c.token_ids, c.logprobs)] for chunks in results]


def _on_gpu_kernels(tokenizer, model_type: str, fused: bool):
    """A tiny model of the type on the GPU's invariant kernels, with or without their fusions. Without
    CUDA, SiLU's is left out: the interpreter's exp is not torch's CPU one (the kernel test bounds it)."""
    hf = tiny_hf_model(model_type).to(DEVICE)
    model = PagedCausalLM(hf)
    use_gpu_invariant_kernels(model)
    fusions = model._fusions if CUDA else dataclasses.replace(model._fusions, gated={})
    assert fusions.add_norms and fusions.rotary_and_store is not None
    model.use_gpu_kernels(model._packed, model._norms, model._experts, fusions if fused else NO_FUSIONS)
    return dataclasses.replace(tiny_loaded(tokenizer, model_type), model=model)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS) if CUDA else ["llama", "qwen3", "gemma2"])
async def test_an_engine_on_the_fused_kernels_gives_the_unfused_tokens_and_logprobs(default_tokenizer, model_type):
    """Chunked prompts mixed with decodes; on CUDA every family, and Hugging Face's greedy tokens too."""
    prompts = [list(range(20, 60)), [5, 9, 13], [7] * 11]
    new_tokens = 32 if CUDA else 8
    fused, unfused = [
        await _greedy(_on_gpu_kernels(default_tokenizer, model_type, fused), prompts, new_tokens)
        for fused in (True, False)
    ]
    assert fused == unfused
    if CUDA:
        reference = tiny_hf_model(model_type)
        expected = [[token for token, _ in hf_greedy_logprobs(reference, p, new_tokens)] for p in prompts]
        assert [[token for token, _ in output] for output in fused] == expected
