"""PagedCausalLM: a Hugging Face Llama-family model run over a ragged batch with a paged KV cache."""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from engine.kernels.invariant import PackedLinear
from engine.kv_cache import KVCache
from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.quant import Int4Weight

if TYPE_CHECKING:
    # Triton: on a CPU only in the dev extras, so imported where a GPU uses it.
    from engine.kernels.gpu_invariant import InvariantLinear, InvariantRMSNorm

SUPPORTED_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class HeadOutput:
    """A forward's float32 logits [R, V] and, where the output head ran on the batch-invariant kernel,
    the largest logit of each 256-token block [R, ceil(V / 256)] (the sampler's block): found while
    the kernel held them in cache, they spare the sampler a pass over each row for its max."""

    logits: torch.Tensor
    block_max: torch.Tensor | None = None


class PagedCausalLM:
    """Reuses the HF model's embeddings, norms, projections, MLPs and rotary embedding;
    replaces its attention with paged_attention so requests of any length share one forward.

    With int4 copies of its linear layers (use_int4), a step of at most
    `int4_max_tokens` tokens runs on those instead of the full-precision weights, unless
    the caller says it computes prompt tokens.

    With the batch-invariant kernels (use_kernels on a CPU, use_gpu_kernels on a GPU), every other
    linear layer and the attention (on a GPU: the norms; its paged attention already is) run on
    those, so a token's logits depend on its own request alone.
    """

    def __init__(self, hf_model: PreTrainedModel) -> None:
        config = hf_model.config
        if config.model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {config.model_type!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.num_layers = len(self.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.vocab_size = config.vocab_size
        attn = self.layers[0].self_attn
        self.scale = float(getattr(attn, "scaling", self.head_dim**-0.5))
        self.dtype = hf_model.dtype
        self.device = hf_model.device
        self.int4_max_tokens = 0
        self._int4: dict[torch.nn.Linear, Int4Weight] = {}
        # The batch-invariant kernels' library, or None for torch's kernels.
        self.kernels: ctypes.CDLL | None = None
        self._packed: dict[torch.nn.Linear, PackedLinear | InvariantLinear] = {}
        self._norms: dict[torch.nn.Module, InvariantRMSNorm] = {}

    def use_int4(self, weights: dict[torch.nn.Linear, Int4Weight], max_tokens: int) -> None:
        """Run steps of at most `max_tokens` tokens on these int4 copies of linear layers."""
        self._int4 = weights
        self.int4_max_tokens = max_tokens if weights else 0

    def use_kernels(self, library: ctypes.CDLL, packed: dict[torch.nn.Linear, PackedLinear]) -> None:
        """Run these packed linear layers and the attention on the batch-invariant kernels."""
        self.kernels = library
        self._packed = packed

    def use_gpu_kernels(
        self, linears: dict[torch.nn.Linear, InvariantLinear], norms: dict[torch.nn.Module, InvariantRMSNorm]
    ) -> None:
        """Run these linear layers and norms on the GPU's batch-invariant Triton kernels."""
        self._packed = linears
        self._norms = norms

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's logits depend on its own request alone, whatever shares its step."""
        return self.kernels is not None or bool(self._norms)

    def first_layers(self, num_layers: int) -> PagedCausalLM:
        """A self-draft: the same embeddings, final norm and head over only the first layers
        (an early exit). Shares every weight with this model."""
        if not 1 <= num_layers < self.num_layers:
            raise ValueError(f"a self-draft needs 1 to {self.num_layers - 1} layers, got {num_layers}")
        draft = copy.copy(self)
        draft.layers = self.layers[:num_layers]
        draft.num_layers = num_layers
        return draft

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        logits_indices: torch.Tensor,
        allow_int4: bool = True,
    ) -> HeadOutput:
        """[T] tokens → float32 logits [R, V] for the R tokens at `logits_indices`."""
        num_tokens = input_ids.shape[0]
        weights = self._int4 if allow_int4 and num_tokens <= self.int4_max_tokens else self._packed

        def replacement(linear: torch.nn.Linear) -> Int4Weight | PackedLinear | None:
            return weights.get(linear) or self._packed.get(linear)

        def project(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            replaced = replacement(linear)
            return linear(x) if replaced is None else replaced(x)

        def normalize(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            replaced = self._norms.get(norm)
            return norm(x) if replaced is None else replaced(x)

        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(hidden[None], positions[None])
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = normalize(layer.input_layernorm, hidden)
            q = project(attn.q_proj, x).view(num_tokens, self.num_heads, self.head_dim)
            k = project(attn.k_proj, x).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = project(attn.v_proj, x).view(num_tokens, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = normalize(attn.q_norm, q), normalize(attn.k_norm, k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = paged_attention(q, k, v, kv_cache.key[index], kv_cache.value[index], meta, self.scale)
            hidden = hidden + project(attn.o_proj, o.view(num_tokens, -1))
            x = normalize(layer.post_attention_layernorm, hidden)
            mlp = layer.mlp
            hidden = hidden + project(mlp.down_proj, mlp.act_fn(project(mlp.gate_proj, x)) * project(mlp.up_proj, x))
        hidden = normalize(self.norm, hidden[logits_indices])
        head = replacement(self.lm_head)
        if isinstance(head, PackedLinear):
            return HeadOutput(*head.with_block_max(hidden))
        return HeadOutput(project(self.lm_head, hidden).float())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
