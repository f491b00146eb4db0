"""PagedCausalLM: a Hugging Face decoder-only model run over a ragged batch with a paged KV cache."""

from __future__ import annotations

import copy
import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from engine.kernels.cpu.decoder import InvariantDecoder
from engine.kernels.cpu.invariant import CACHE_DTYPES, PackedLinear
from engine.kv_cache import KVCache
from engine.model.attention.invariant import InvariantMetadata
from engine.model.attention.paged import AttentionMetadata
from engine.model.families import decoder_of, family_of, vision_of
from engine.model.layers import NO_FUSIONS, ExpertsKernel, Fusions, LayerOps, Replacement

if TYPE_CHECKING:
    # Triton: on a CPU only in the dev extras, so imported where a GPU uses it.
    from engine.kernels.gpu.invariant import InvariantLinear, InvariantRMSNorm


@dataclass(frozen=True)
class HeadOutput:
    """A forward's float32 logits [R, V] and, where the output head ran on the batch-invariant kernel,
    the largest logit of each 256-token block [R, ceil(V / 256)] (the sampler's block): found while
    the kernel held them in cache, they spare the sampler a pass over each row for its max."""

    logits: torch.Tensor
    block_max: torch.Tensor | None = None


@dataclass(frozen=True)
class ImageRows:
    """Image embeddings for a forward: row i of `embeddings` replaces the embedding of token `indices[i]`
    of the step (after the family's own embedding, as Hugging Face's models put them)."""

    indices: torch.Tensor
    embeddings: torch.Tensor


class PagedCausalLM:
    """Runs the HF model's modules as its family (engine/model/families/) composes them, with attention
    over the paged cache so requests of any length share one forward.

    With the batch-invariant kernels (use_kernels on a CPU, use_gpu_kernels on a GPU), every other
    linear layer and the attention (on a GPU: the norms; its paged attention already is) run on
    those, so a token's logits depend on its own request alone.
    """

    def __init__(self, hf_model: PreTrainedModel) -> None:
        # Raises UnsupportedModelError for a model_type no family serves.
        # A vision-language model's images (None for a text model); its decoder is run as a text model's.
        self.vision = vision_of(hf_model)
        text = self.vision.language() if self.vision is not None else hf_model
        self.family = decoder_of(self.vision) if self.vision is not None else family_of(text)
        config = text.config
        inner = text.model
        # The modules the decoder runs (through LayerOps, on whichever kernels): its layers and the head.
        self.decoder_modules: tuple[torch.nn.Module, ...] = (*inner.modules(), hf_model.lm_head)
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        self.num_layers = len(self.layers)
        shape = self.family.attention
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.vocab_size = config.vocab_size
        self.max_position_embeddings: int = config.max_position_embeddings
        self.dtype = hf_model.dtype
        # The KV cache's element type: the model's, or a narrower one on the CPU kernels (use_kv_dtype).
        self.kv_dtype = self.dtype
        self.device = hf_model.device
        # The batch-invariant kernels' library, or None for torch's kernels.
        self.kernels: ctypes.CDLL | None = None
        self._packed: dict[torch.nn.Linear, PackedLinear | InvariantLinear] = {}
        self._norms: dict[torch.nn.Module, InvariantRMSNorm] = {}
        # The mixture-of-experts blocks on kernels of their own (engine/model/moe.py), by block.
        self._experts: dict[torch.nn.Module, ExpertsKernel] = {}
        # Kernels doing several ops' work in one launch (the GPU's).
        self._fusions: Fusions = NO_FUSIONS
        # Every decoder layer in one call of the CPU kernels, where the family's layer is theirs.
        self._decoder: InvariantDecoder | None = None
        # What each linear layer runs on.
        self._linears: Mapping[torch.nn.Module, Replacement] = {}

    def use_kernels(
        self,
        library: ctypes.CDLL,
        packed: dict[torch.nn.Linear, PackedLinear],
        experts: dict[torch.nn.Module, ExpertsKernel] | None = None,
        decoder: InvariantDecoder | None = None,
    ) -> None:
        """Run these packed linear layers, mixture-of-experts blocks and the attention on the
        batch-invariant kernels; `decoder`, where given, runs all the decoder layers in one call."""
        self.kernels = library
        self._packed = packed
        self._experts = experts or {}
        self._decoder = decoder
        self._replacements_changed()

    def use_kv_dtype(self, dtype: torch.dtype) -> None:
        """Keep the KV cache in `dtype` (--kv-cache-dtype). Other than the model's only on the batch-invariant CPU
        kernels: their attention widens a bfloat16 or float16 cache exactly as it reads it;
        torch's SDPA and the GPU's kernels would read it as another type, so they refuse."""
        if dtype != self.dtype and (self.kernels is None or dtype not in CACHE_DTYPES):
            raise ValueError(
                f"--kv-cache-dtype {str(dtype).removeprefix('torch.')} differs from the model's "
                f"{str(self.dtype).removeprefix('torch.')} and needs the batch-invariant CPU kernels "
                "(leave out --kv-cache-dtype, or pass the model's type)"
            )
        self.kv_dtype = dtype

    def use_gpu_kernels(
        self,
        linears: dict[torch.nn.Linear, InvariantLinear],
        norms: dict[torch.nn.Module, InvariantRMSNorm],
        experts: dict[torch.nn.Module, ExpertsKernel] | None = None,
        fusions: Fusions = NO_FUSIONS,
    ) -> None:
        """Run these linear layers, norms and mixture-of-experts blocks on the GPU's batch-invariant
        Triton kernels, and what `fusions` fuses on its fused kernels."""
        self._packed = linears
        self._norms = norms
        self._experts = experts or {}
        self._fusions = fusions
        self._replacements_changed()

    def _replacements_changed(self) -> None:
        self._linears = dict(self._packed)

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's logits depend on its own request alone, whatever shares its step."""
        return self.kernels is not None or bool(self._norms)

    @property
    def windows(self) -> tuple[int, ...]:
        """The sliding window of each layer this model runs (0: global); a self-draft runs the first."""
        return self.family.windows[: self.num_layers]

    def first_layers(self, num_layers: int) -> PagedCausalLM:
        """A self-draft: the same embeddings, final norm and head over only the first layers
        (an early exit). Shares every weight with this model."""
        if not 1 <= num_layers < self.num_layers:
            raise ValueError(f"a self-draft needs 1 to {self.num_layers - 1} layers, got {num_layers}")
        draft = copy.copy(self)
        draft.layers = self.layers[:num_layers]
        draft.num_layers = num_layers
        if self._decoder is not None:
            draft._decoder = self._decoder.first_layers(num_layers)
        return draft

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor,
        image_rows: ImageRows | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> HeadOutput:
        """[T] tokens → float32 logits [R, V] for the R tokens at `logits_indices`; `image_rows` puts
        images' embeddings in place of their tokens' (a vision-language model's prompts); `rope_positions`
        [3, T] rotates each token by three positions instead of `positions` (M-RoPE, where a step holds a
        request with images)."""
        ops = LayerOps(self._linears, self._norms, kv_cache, meta, self._experts, self._fusions)
        family = self.family
        hidden = family.embed(self.embed_tokens, input_ids)
        if image_rows is not None:
            hidden[image_rows.indices] = image_rows.embeddings.to(hidden.dtype)
        rotary = family.rotary(hidden, positions if rope_positions is None else rope_positions)
        decoder = self._decoder if isinstance(meta, InvariantMetadata) else None
        if decoder is not None and decoder.runs(rotary.cos, kv_cache):
            hidden = decoder(hidden, rotary.cos, rotary.sin, kv_cache, meta.slot_mapping, meta.kernel)
        else:
            for index, layer in enumerate(self.layers):
                hidden = family.layer(ops, index, layer, hidden, rotary)
        hidden = ops.normalize(self.norm, hidden[logits_indices])
        head = self._linears.get(self.lm_head)
        if isinstance(head, PackedLinear) and head.bias is None and not family.transforms_logits:
            return HeadOutput(*head.with_block_max(hidden))
        return HeadOutput(family.logits(ops.project(self.lm_head, hidden).float()))
