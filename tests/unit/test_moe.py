"""The mixture-of-experts block (engine/model/moe.py) on each of its kernels: Hugging Face's own block's
results, and on the batch-invariant ones (the CPU's, engine/kernels/experts.py; the GPU's per-expert Triton
linear layers, in Triton's interpreter without a GPU) a token's bits the same whatever else is in its step."""

import pytest
import torch
from transformers import AutoConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from engine.kernels.native import load_library
from engine.model.layers import LayerOps
from engine.model.loader import _pack_experts
from engine.model.moe import sparse_moe
from tests.conftest import CACHE_DIR

HIDDEN = 64
TOP_K = 4
NUM_TOKENS = 40


def _block(model_type: str) -> torch.nn.Module:
    """16 experts of width 40 (not a multiple of the kernel's 16-column panels), random weights."""
    torch.manual_seed(0)
    if model_type == "mixtral":
        config = AutoConfig.for_model(
            "mixtral", hidden_size=HIDDEN, intermediate_size=40, num_local_experts=16, num_experts_per_tok=TOP_K
        )
        block = MixtralSparseMoeBlock(config)
    else:
        config = AutoConfig.for_model(
            "qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=40, num_experts=16, num_experts_per_tok=TOP_K
        )
        block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0, 0.2)
    return block.eval()


def _renormalize(model_type: str) -> bool:
    return model_type == "mixtral"


def _hf(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x[None])[0]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_torch_path_is_hugging_faces_block(model_type):
    block = _block(model_type)
    x = torch.randn(NUM_TOKENS, HIDDEN)
    ops = LayerOps({}, {}, None, None, {})  # no kernels: torch's path, which needs no cache
    with torch.no_grad():
        out = sparse_moe(ops, block, x, TOP_K, _renormalize(model_type))
    torch.testing.assert_close(out, _hf(block, x))


def _rows_alone_and_together(kernel, x, renormalize):
    together = kernel(x, TOP_K, renormalize, torch.nn.functional.silu)
    for start, count in ((0, 1), (3, 1), (5, 7), (17, 23)):
        part = kernel(x[start : start + count], TOP_K, renormalize, torch.nn.functional.silu)
        assert torch.equal(part, together[start : start + count])
    return together


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_cpu_kernels_are_hugging_faces_block_and_a_tokens_own(model_type):
    library = load_library(CACHE_DIR)
    assert library is not None, "these tests run where the kernels do: x86-64 with AVX2"
    block = _block(model_type)
    x = torch.randn(NUM_TOKENS, HIDDEN)
    expected = _hf(block, x)
    kernel = _pack_experts(library, block)
    together = _rows_alone_and_together(kernel, x, _renormalize(model_type))
    torch.testing.assert_close(together, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.interpreter
def test_gpu_kernels_are_hugging_faces_block_and_a_tokens_own():
    pytest.importorskip("triton", reason="the GPU's batch-invariant kernels are written in Triton")
    from engine.kernels.gpu_invariant import InvariantLinear
    from engine.model.moe import ExpertLinears

    device = "cuda" if torch.cuda.is_available() else "cpu"
    block = _block("qwen3_moe").to(device)
    x = torch.randn(NUM_TOKENS, HIDDEN, device=device)
    experts = block.experts
    kernel = ExpertLinears(
        InvariantLinear(block.gate.weight.detach(), None, torch.float32),
        tuple(InvariantLinear(w, None, torch.float32) for w in experts.gate_up_proj.detach()),
        tuple(InvariantLinear(w, None, torch.float32) for w in experts.down_proj.detach()),
    )
    if torch.cuda.is_available():
        together = _rows_alone_and_together(kernel, x, False)
    else:
        # Triton's interpreter multiplies a tile with numpy, whose sums differ with the rows' place in
        # memory (tests/unit/test_gpu_invariant.py): there only the results are checked, not their bits.
        together = kernel(x, TOP_K, False, torch.nn.functional.silu)
    torch.testing.assert_close(together, _hf(block, x), rtol=1e-4, atol=1e-5)
