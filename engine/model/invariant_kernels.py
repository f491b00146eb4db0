"""A loaded model's layers on the batch-invariant kernels: on a CPU its linear layers packed in the form their
source ships (GGUF blocks, bf16, fp16, float32; or quantized at load), its experts grouped, Llama-shaped decoders in one
call a step; on a GPU the Triton linear layers and norms and the fusions of a layer."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType, quants
from transformers import PreTrainedModel

from engine.kernels.cpu.decoder import InvariantDecoder
from engine.kernels.cpu.experts import InvariantExperts, PackedExperts
from engine.kernels.cpu.invariant import PackedEmbedding, PackedLinear, WeightForm, narrowest
from engine.kernels.cpu.native import kernel_variant, load_library
from engine.model.causal_lm import PagedCausalLM
from engine.model.gguf_index import read_gguf_index
from engine.model.gguf_weights import shipped_blocks
from engine.model.invariant_tower import cpu_linear_kernel, gpu_linear_kernel, use_invariant_tower
from engine.model.layers import Fusions
from engine.model.moe import ExpertLinears, ExpertMatrices, router_of, sparse_blocks

if TYPE_CHECKING:
    # Triton: on a CPU only in the dev extras, so imported where a GPU uses it.
    from engine.kernels.gpu.invariant import InvariantLinears, InvariantRMSNorm

logger = logging.getLogger(__name__)


def use_invariant_kernels(
    paged: PagedCausalLM,
    hf_model: PreTrainedModel,
    cache_dir: Path,
    gguf: Path | None = None,
    quantize: str | None = None,
) -> None:
    """Moves every linear layer into the invariant kernels' layout (freeing the original where
    nothing else shares it) and routes attention through them; logs why not where they cannot run.

    Each weight is kept in the precision its source has: the GGUF `gguf`'s blocks (it is the model's
    source), bfloat16 or float16 where every value is one, else float32. A form is kept only where the values the
    kernel widens it to are exactly the float32 weight's, so the outputs are the float32 kernel's bits.
    `quantize` ("q8_0", "q4_1") instead quantizes every layer whose input width allows it into that form
    (the output head into Q8_0)."""
    if paged.device.type == "cuda":
        use_gpu_invariant_kernels(paged)
        return
    if paged.device.type != "cpu" or paged.dtype != torch.float32 or paged.head_dim % 8 or paged.head_dim > 256:
        logger.warning(
            "batch invariance is off: its kernels take float32 on a CPU with a head size that is a multiple "
            "of 8 up to 256, or a CUDA GPU; this model is %s on %s with heads of %d",
            paged.dtype,
            paged.device,
            paged.head_dim,
        )
        return
    library = load_library(cache_dir)
    if library is None:
        return
    blocks = shipped_blocks(read_gguf_index(gguf, cache_dir), hf_model) if gguf is not None and quantize is None else {}
    shared = {hf_model.get_input_embeddings().weight.data_ptr()}
    packed = {}
    # The decoder's layers here; a vision tower's below, each on its own kernel in Hugging Face's modules.
    for module in paged.decoder_modules:
        if isinstance(module, torch.nn.Linear):
            if quantize is not None and module.in_features % 32 == 0:
                form = WeightForm.Q8_0 if quantize == "q8_0" or module is paged.lm_head else WeightForm.Q4_1
                weight = _pack_quantized(library, module, form)
            else:
                weight = _pack_as_shipped(library, module, blocks.get(module))
            packed[module] = (
                weight if module.bias is None else dataclasses.replace(weight, bias=module.bias.detach().float())
            )
            if module.weight.data_ptr() not in shared:
                module.weight.data = torch.empty(0)
    experts = {block: _pack_experts(library, block) for block in sparse_blocks(paged.decoder_modules[0])}
    embeddings, head = paged.embed_tokens, packed.get(paged.lm_head)
    if (
        quantize is None
        and type(embeddings) is torch.nn.Embedding
        and embeddings.max_norm is None
        and head is not None
        and paged.lm_head.weight is embeddings.weight
    ):
        # Tied: the head's packed copy holds the embedding's values exactly, zeros' signs aside (_pack_as_shipped
        # keeps no other).
        paged.embed_tokens = PackedEmbedding(head)
        embeddings.weight.data = torch.empty(0)
    tower = use_invariant_tower(paged.vision, cpu_linear_kernel(library)) if paged.vision is not None else 0
    # What is left (norms, an untied embedding) may still be views of the checkpoint's memory map, and one view
    # keeps the whole map, which packing read through, resident: copied out of it, the map goes.
    for parameter in hf_model.parameters():
        if parameter.numel():
            parameter.data = parameter.data.clone()
    family = paged.family
    decoder = None
    if family.llama_layer:
        shape = family.attention
        heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
        decoder = InvariantDecoder.of(library, paged.layers, packed, family.windows, *heads, shape.scale)
    paged.use_kernels(library, packed, experts, decoder)
    forms = Counter(linear.form.name for linear in packed.values())
    logger.info(
        "batch-invariant kernels (%s) for %d linear layers (%s), %d mixture-of-experts blocks and attention%s%s",
        kernel_variant(library),
        len(packed),
        ", ".join(f"{count} {form}" for form, count in sorted(forms.items())),
        len(experts),
        "; the decoder layers in one call a step" if decoder is not None else "",
        f"; {tower} of the vision tower's layers" if tower else "",
    )


def _pack_quantized(library: ctypes.CDLL, module: torch.nn.Linear, form: WeightForm) -> PackedLinear:
    """The layer's weight quantized into GGUF blocks of `form` (gguf's own quantizer, as llama.cpp's
    convert script writes them)."""
    kind = {WeightForm.Q8_0: GGMLQuantizationType.Q8_0, WeightForm.Q4_1: GGMLQuantizationType.Q4_1}[form]
    blocks = torch.from_numpy(quants.quantize(module.weight.detach().float().numpy(), kind))
    return PackedLinear.pack_blocks(library, form, blocks, module.out_features, module.in_features)


def _pack_experts(library: ctypes.CDLL, block: torch.nn.Module) -> InvariantExperts:
    """A mixture-of-experts block's router and experts (3D parameters, not linear layers) packed for the
    kernels, each in the narrowest form that keeps its values; the originals freed."""
    router, matrices = router_of(block), ExpertMatrices.of(block.experts)
    packed_router = PackedLinear.pack(library, narrowest(router.weight))
    if getattr(router, "bias", None) is not None:
        packed_router = dataclasses.replace(packed_router, bias=router.bias.detach().float())
    packed = InvariantExperts(
        library,
        packed_router,
        PackedExperts.pack(library, matrices.gate_up),
        PackedExperts.pack(library, matrices.down),
        _float_or_none(matrices.gate_up_bias),
        _float_or_none(matrices.down_bias),
    )
    for parameter in (*router.parameters(), *block.experts.parameters()):
        parameter.data = torch.empty(0)
    return packed


def _float_or_none(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.float().contiguous()


def _pack_as_shipped(
    library: ctypes.CDLL, module: torch.nn.Linear, blocks: tuple[WeightForm, torch.Tensor] | None
) -> PackedLinear:
    weight = module.weight.detach()
    if blocks is None:
        return PackedLinear.pack(library, narrowest(weight))
    candidate = PackedLinear.pack_blocks(library, *blocks, module.out_features, module.in_features)
    if same_weights(candidate.unpacked(), weight.float()):
        return candidate
    return PackedLinear.pack(library, weight)


def same_weights(widened: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a packed weight widens to `weight` bit for bit, zeros of either sign alike. A zero weight's sign
    changes at most the sign of a zero result: every kernel's multiply-add chain starts from +0 and rounds to
    nearest, where adding a zero product of either sign leaves a nonzero sum as it is and turns +0 into +0; only a
    sum already at -0 (a negative product too small for float32) would end -0 with one and +0 with the other.
    Nothing downstream reads a zero's sign (norms, linear layers, attention, softmax and sampling add, multiply
    and compare; none divides by such a value), so the tokens and logprobs are the same."""
    widened, weight = widened.view(torch.int32), weight.view(torch.int32)
    # Clearing the sign bit: +0 and -0 both read 0, and no other two values are then equal.
    zeros = (widened & 0x7FFFFFFF == 0) & (weight & 0x7FFFFFFF == 0)
    return bool(torch.where(zeros, True, widened == weight).all())


def use_gpu_invariant_kernels(paged: PagedCausalLM) -> None:
    """Every linear layer and RMSNorm on the GPU's Triton kernels of a fixed order; the paged attention
    kernels already compute each token on its own. Logs why not where Triton is missing."""
    if importlib.util.find_spec("triton") is None:
        logger.warning("batch invariance is off: its GPU kernels need Triton (it ships with CUDA PyTorch)")
        return
    from engine.kernels.gpu.invariant import InvariantLinear, InvariantRMSNorm

    # Before the layers' own kernels: stacking makes their weights views of the stacks.
    groups = stack_projections(paged.decoder_modules)
    linears = {
        module: InvariantLinear.of(module) for module in paged.decoder_modules if isinstance(module, torch.nn.Linear)
    }
    linears[paged.lm_head] = InvariantLinear.of(paged.lm_head, torch.float32)
    norms = {
        module: InvariantRMSNorm.of(module) for module in paged.decoder_modules if InvariantRMSNorm.supports(module)
    }
    experts = {block: _gpu_experts(block) for block in sparse_blocks(paged.decoder_modules[0])}
    fusions = gpu_fusions(paged.decoder_modules, groups, norms)
    paged.use_gpu_kernels(linears, norms, experts, fusions)
    tower = use_invariant_tower(paged.vision, gpu_linear_kernel()) if paged.vision is not None else 0
    logger.info(
        "batch-invariant GPU kernels for %d linear layers (%d stacked in %d launches), %d norms (%d adding the"
        " residual) and %d mixture-of-experts blocks; %d gated activations fused%s",
        len(linears),
        sum(len(group) for group in groups),
        len(groups),
        len(norms),
        len(fusions.add_norms),
        len(experts),
        len(fusions.gated),
        f"; {tower} of the vision tower's layers" if tower else "",
    )


def stack_projections(modules: Iterable[torch.nn.Module]) -> dict[tuple[torch.nn.Module, ...], InvariantLinears]:
    """Each attention block's q/k/v and each MLP's gate/up among `modules` stacked into one batch-invariant
    layer, where they are plain linear layers that can stack."""
    from engine.kernels.gpu.invariant import InvariantLinears

    groups = {}
    for module in modules:
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            linears = tuple(getattr(module, name, None) for name in names)
            if all(linear is not None for linear in linears) and InvariantLinears.fusable(linears):
                groups[linears] = InvariantLinears.of(linears)
    return groups


def gpu_fusions(
    modules: Iterable[torch.nn.Module],
    groups: dict[tuple[torch.nn.Module, ...], InvariantLinears],
    norms: dict[torch.nn.Module, InvariantRMSNorm],
) -> Fusions:
    """The GPU's fused kernels for this model: its stacked projections, every invariant norm adding the
    residual in its launch, SiLU's gated product and the rotary embedding with the cache's write."""
    from engine.kernels.gpu.activation import silu_and_mul
    from engine.kernels.gpu.rotary import rotary_and_store

    return Fusions(
        groups=groups,
        add_norms={module: norm.add for module, norm in norms.items()},
        gated={module: silu_and_mul for module in modules if type(module).__name__ in _SILU},
        rotary_and_store=rotary_and_store,
    )


# transformers' SiLU modules: torch's own, and its wrapper that a hub kernel may replace.
_SILU = ("SiLU", "SiLUActivation")


def _gpu_experts(block: torch.nn.Module) -> ExpertLinears:
    """A mixture-of-experts block's router and each expert's projections on the GPU's invariant linear layer."""
    from engine.kernels.gpu.invariant import InvariantLinear

    router, matrices = router_of(block), ExpertMatrices.of(block.experts)
    bias = getattr(router, "bias", None)

    def linears(weights: torch.Tensor, biases: torch.Tensor | None) -> tuple[InvariantLinear, ...]:
        # Transposed experts (gpt-oss's) are copied into the kernel's [N, K] rows.
        return tuple(
            InvariantLinear(weights[e].contiguous(), None if biases is None else biases[e], weights.dtype)
            for e in range(weights.shape[0])
        )

    kernel = ExpertLinears(
        InvariantLinear(router.weight.detach(), None if bias is None else bias.detach(), router.weight.dtype),
        linears(matrices.gate_up, matrices.gate_up_bias),
        linears(matrices.down, matrices.down_bias),
    )
    if getattr(block.experts, "is_transposed", False):
        # The copies replace them (untransposed experts' kernels hold views of the same memory).
        block.experts.gate_up_proj.data = block.experts.down_proj.data = torch.empty(0)
    return kernel
