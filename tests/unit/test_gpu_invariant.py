"""The GPU's batch-invariant linear and RMSNorm kernels (engine/kernels/gpu/invariant.py): torch's
results, and each row's bits the same whatever rows share its launch. On a machine without CUDA they
run in Triton's interpreter on the CPU; without Triton the file skips. On CUDA, the engine built as a
server builds it: a greedy request's tokens the same alone, in a batch, from the prefix cache and
with speculation."""

import asyncio
import random

import pytest
import torch

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET: the kernels run in Triton's interpreter.
pytest.importorskip("triton", reason="the GPU's batch-invariant kernels are written in Triton")
pytestmark = pytest.mark.interpreter

from engine.config import SpeculativeConfig  # noqa: E402
from engine.kernels.gpu.invariant import InvariantLinear, InvariantRMSNorm, linear_config  # noqa: E402
from engine.tiny import tiny_engine, tiny_hf_model, tiny_loaded  # noqa: E402
from engine.types import SamplingParams  # noqa: E402
from tests.conftest import CACHE_DIR  # noqa: E402
from tests.unit.helpers import collect, tokens_of  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter multiplies bfloat16 operands of tl.dot as their bits' integers: bfloat16 runs on CUDA only.
DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter gets bfloat16 dots wrong"),
    ),
]
# Row counts: alone, a few, and on CUDA more than a decode step's tile, where the wider tiles take over
# (on an H100 a tile's shape does not change its sums' bits), each a part of a launch of more rows.
# Triton's interpreter multiplies a tile with numpy, whose sums do depend on the tile's shape, so there
# every launch stays within one kind of tile (up to 64 rows).
ROW_COUNTS = (1, 5, 70) if torch.cuda.is_available() else (1, 5, 40)
NUM_ROWS = 100 if torch.cuda.is_available() else 64


def _rows_alone_and_together(fn, x):
    together = fn(x)
    assert max(ROW_COUNTS) < len(x)
    for count in ROW_COUNTS:
        part = fn(x[:count])
        assert torch.equal(part, together[:count]), count
    assert torch.equal(fn(x[3:4]), together[3:4])
    return together


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"), [(64, 48, False), (200, 130, True), (96, 4100, False)]
)
def test_linear_matches_torch_and_a_row_is_the_same_in_any_batch(dtype, in_features, out_features, bias):
    generator = torch.Generator().manual_seed(in_features + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) / in_features**0.5)
    linear = linear.to(DEVICE, dtype)
    x = torch.randn(NUM_ROWS, in_features, generator=generator).to(DEVICE, dtype)
    kernel = InvariantLinear.of(linear)
    out = _rows_alone_and_together(kernel, x)
    assert out.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, linear(x).detach(), rtol=tolerance, atol=tolerance)
    head = InvariantLinear.of(linear, torch.float32)(x)
    assert head.dtype == torch.float32
    torch.testing.assert_close(head, linear(x).detach().float(), rtol=tolerance, atol=tolerance)


def test_every_tile_sums_over_k_in_the_same_steps():
    configs = {linear_config(n, rows) for n in (16, 2048, 4096, 8192, 49152) for rows in (1, 64, 65, 2048)}
    assert len({config.block_k for config in configs}) == 1 and len(configs) > 3
    assert linear_config(2048, 64) != linear_config(2048, 65)


def _hf_norm(kind: str, width: int, eps: float):
    """A Hugging Face RMSNorm of each arithmetic the kernel takes (its weight drawn, Gemma's about 0)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = {"llama": LlamaRMSNorm, "gpt_oss": GptOssRMSNorm, "gemma": Gemma3RMSNorm}[kind](width, eps=eps)
    generator = torch.Generator().manual_seed(width)
    with torch.no_grad():
        norm.weight.copy_((0.0 if kind == "gemma" else 1.0) + 0.1 * torch.randn(width, generator=generator))
    return norm


@pytest.mark.parametrize("kind", ["llama", "gpt_oss", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hugging_face_s_and_a_row_is_the_same_in_any_batch(dtype, kind):
    generator = torch.Generator().manual_seed(1)
    norm = _hf_norm(kind, 576, 1e-5).to(DEVICE, dtype)
    x = (3 * torch.randn(NUM_ROWS, 576, generator=generator)).to(DEVICE, dtype)
    assert InvariantRMSNorm.supports(norm)
    out = _rows_alone_and_together(InvariantRMSNorm.of(norm), x)
    assert out.dtype == norm(x).dtype == dtype
    # bfloat16: torch's defaults, a rounding step apart (1/64 relative).
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out, norm(x).detach(), **tolerance)
    # A per-head norm (Qwen3's and Gemma 3's q_norm) takes [tokens, heads, head_dim] and normalizes each head.
    per_head = _hf_norm(kind, 64, 1e-6).to(DEVICE, dtype)
    heads = x[:6, :512].reshape(6, 8, 64)
    torch.testing.assert_close(InvariantRMSNorm.of(per_head)(heads), per_head(heads).detach(), **tolerance)
    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        return  # Triton's interpreter truncates float32 to bfloat16 where torch rounds to nearest.
    # With the residual added in the same launch: the sum and its norm, the unfused bits.
    total, normed = InvariantRMSNorm.of(norm).add(x, x.flip(0))
    assert torch.equal(total, x + x.flip(0)) and torch.equal(normed, InvariantRMSNorm.of(norm)(x + x.flip(0)))


def test_loading_on_cuda_moves_every_linear_layer_and_norm_onto_the_kernels():
    if not torch.cuda.is_available():
        pytest.skip("the GPU kernels are chosen for CUDA models")
    from engine.model.causal_lm import PagedCausalLM
    from engine.model.invariant_kernels import use_gpu_invariant_kernels

    hf = tiny_hf_model().to("cuda")
    model = PagedCausalLM(hf)
    use_gpu_invariant_kernels(model)
    assert model.batch_invariant and model.kernels is None
    # Two layers of q, k, v, o, gate, up, down, and the head; two norms a layer and the final one.
    assert len(model._packed) == 2 * 7 + 1 and len(model._norms) == 2 * 2 + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine runs the GPU kernels on CUDA")
@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", num_tokens=4, max_batch_size=96)])
async def test_a_greedy_bfloat16_request_gets_the_same_tokens_alone_in_a_batch_and_from_the_cache(
    default_tokenizer, speculative
):
    """bfloat16, where rounding differences show soon. The engine a server builds (graphs captured): a
    request alone, then the same among 95 others of other lengths (other graph buckets, decode steps
    on both sides of the linear kernel's switch of tiles, mixed steps with their prompt chunks), then
    again with its prompt in the prefix cache."""
    loaded = tiny_loaded(
        default_tokenizer,
        repetitive=speculative is not None,
        kernels_cache=CACHE_DIR,
        device="cuda",
        dtype=torch.bfloat16,
    )
    rng = random.Random(11)
    prompt = [rng.randrange(1, 400) for _ in range(37)]
    others = [[rng.randrange(1, 400) for _ in range(rng.randint(3, 60))] for _ in range(95)]
    engine = tiny_engine(loaded, block_size=16, max_num_seqs=96, max_num_batched_tokens=256, speculative=speculative)
    assert engine.runner.graphs is not None
    params = SamplingParams(max_tokens=48, temperature=0.0)
    engine.start()
    try:
        alone = tokens_of(await collect(engine, prompt, params))
        results = await asyncio.gather(
            *[collect(engine, p, SamplingParams(max_tokens=8 + i, temperature=0.0)) for i, p in enumerate(others)],
            collect(engine, prompt, params),
        )
        cached = tokens_of(await collect(engine, prompt, params))
    finally:
        engine.shutdown()
    assert tokens_of(results[-1]) == alone
    assert cached == alone
