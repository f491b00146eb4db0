"""The mixture-of-experts block (engine/model/moe.py) on each of its kernels: Hugging Face's own block's
results, and on the batch-invariant ones (the CPU's, engine/kernels/cpu/experts.py; the GPU's per-expert Triton
linear layers, in Triton's interpreter without a GPU) a token's bits the same whatever else is in its step."""

import pytest
import torch
from transformers import AutoConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from engine.kernels.cpu.native import load_library
from engine.model.invariant_kernels import _pack_experts
from engine.model.layers import LayerOps
from engine.model.moe import ExpertMatrices, Routing, router_of, sparse_moe
from tests.conftest import CACHE_DIR

HIDDEN = 64
TOP_K = 4
NUM_TOKENS = 40


MODEL_TYPES = ["gpt_oss", "mixtral", "qwen3_moe"]


def _block(model_type: str) -> torch.nn.Module:
    """16 experts of width 40 (not a multiple of the kernel's 16-column panels), random weights (and biases)."""
    torch.manual_seed(0)
    if model_type == "mixtral":
        config = AutoConfig.for_model(
            "mixtral", hidden_size=HIDDEN, intermediate_size=40, num_local_experts=16, num_experts_per_tok=TOP_K
        )
        block = MixtralSparseMoeBlock(config)
    elif model_type == "gpt_oss":
        # A clamp that bites on about a third of the gate-up outputs.
        config = AutoConfig.for_model(
            "gpt_oss",
            hidden_size=HIDDEN,
            intermediate_size=40,
            num_local_experts=16,
            num_experts_per_tok=TOP_K,
            swiglu_limit=2.0,
        )
        block = GptOssMLP(config)
    else:
        config = AutoConfig.for_model(
            "qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=40, num_experts=16, num_experts_per_tok=TOP_K
        )
        block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.2)
    return block.eval()


def _routing(model_type: str) -> Routing:
    return {"gpt_oss": Routing.TOP_K_SOFTMAX, "mixtral": Routing.SOFTMAX_RENORMALIZED}.get(model_type, Routing.SOFTMAX)


def _hf(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(x[None])
    # gpt-oss's block returns its router scores too.
    return (out[0] if isinstance(out, tuple) else out)[0]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_torch_path_is_hugging_faces_block(model_type):
    block = _block(model_type)
    x = torch.randn(NUM_TOKENS, HIDDEN)
    ops = LayerOps({}, {}, None, None, {})  # no kernels: torch's path, which needs no cache
    with torch.no_grad():
        out = sparse_moe(ops, block, x, TOP_K, _routing(model_type))
    torch.testing.assert_close(out, _hf(block, x))


def _rows_alone_and_together(kernel, x, routing, gate):
    together = kernel(x, TOP_K, routing, gate)
    for start, count in ((0, 1), (3, 1), (5, 7), (17, 23)):
        part = kernel(x[start : start + count], TOP_K, routing, gate)
        assert torch.equal(part, together[start : start + count])
    return together


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_cpu_kernels_are_hugging_faces_block_and_a_tokens_own(model_type):
    library = load_library(CACHE_DIR)
    assert library is not None, "these tests run where the kernels do: x86-64 with AVX2"
    block = _block(model_type)
    x = torch.randn(NUM_TOKENS, HIDDEN)
    expected = _hf(block, x)
    gate = block.experts._apply_gate
    kernel = _pack_experts(library, block)
    together = _rows_alone_and_together(kernel, x, _routing(model_type), gate)
    torch.testing.assert_close(together, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_moe"])
def test_gpu_kernels_are_hugging_faces_block_and_a_tokens_own(model_type):
    pytest.importorskip("triton", reason="the GPU's batch-invariant kernels are written in Triton")
    from engine.kernels.gpu.invariant import InvariantLinear
    from engine.model.moe import ExpertLinears

    device = "cuda" if torch.cuda.is_available() else "cpu"
    block = _block(model_type).to(device)
    x = torch.randn(NUM_TOKENS, HIDDEN, device=device)
    router, matrices = router_of(block), ExpertMatrices.of(block.experts)
    bias = getattr(router, "bias", None)

    def linears(weights, biases):
        return tuple(
            InvariantLinear(w.contiguous(), None if biases is None else biases[e], torch.float32)
            for e, w in enumerate(weights)
        )

    kernel = ExpertLinears(
        InvariantLinear(router.weight.detach(), None if bias is None else bias.detach(), torch.float32),
        linears(matrices.gate_up, matrices.gate_up_bias),
        linears(matrices.down, matrices.down_bias),
    )
    gate, routing = block.experts._apply_gate, _routing(model_type)
    if torch.cuda.is_available():
        together = _rows_alone_and_together(kernel, x, routing, gate)
    else:
        # Triton's interpreter multiplies a tile with numpy, whose sums differ with the rows' place in
        # memory (tests/unit/test_gpu_invariant.py): there only the results are checked, not their bits.
        together = kernel(x, TOP_K, routing, gate)
    torch.testing.assert_close(together, _hf(block, x), rtol=1e-4, atol=1e-5)
