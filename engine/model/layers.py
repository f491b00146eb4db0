"""The building blocks the model families are made of: a step's linear layers, norms, experts and paged
attention (`LayerOps`, which picks the kernel each runs on), rotary embeddings, self-attention and the
gated MLP (the mixture-of-experts block is engine/model/moe.py).

A family (engine/model/families/) composes these into its decoder layer; nothing here knows a family."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.kv_cache import KVCache
from engine.model.attention import AttentionMetadata, paged_attention

# What a linear layer or norm runs on instead of torch's module: a kernel's packed copy of its weights.
Replacement = Callable[[torch.Tensor], torch.Tensor]


class ExpertsKernel(Protocol):
    """What a mixture-of-experts block runs on instead of torch's kernels: its router and experts on
    kernels of their own (engine/model/moe.py), x [T, H] → the sum of each token's top_k experts'
    outputs weighted by their routing weights."""

    def __call__(
        self, x: torch.Tensor, top_k: int, renormalize: bool, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Rotary:
    """A step's rotary tables, [T, 1, rotary_dim] each, broadcast over heads. A rotary_dim below the head's
    rotates the head's first rotary_dim features only (partial rotary, as Phi-4-mini has)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def of(cls, rotary_emb: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor, *args: str) -> Rotary:
        """The tables of the model's Hugging Face rotary module (any of its scalings) at `positions`; `args`
        are the module's own after the positions (Gemma 3's layer type)."""
        cos, sin = rotary_emb(hidden[None], positions[None], *args)
        return cls(cos[0].unsqueeze(1), sin[0].unsqueeze(1))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by each token's position."""
        width = self.cos.shape[-1]
        if width == x.shape[-1]:
            return x * self.cos + _rotate_half(x) * self.sin
        rotated, passed = x[..., :width], x[..., width:]
        return torch.cat((rotated * self.cos + _rotate_half(rotated) * self.sin, passed), dim=-1)


@dataclass(frozen=True, slots=True)
class LongRope:
    """LongRoPE's tables (the 128k-context Phi-3 and Phi-3.5, Phi-4-mini), with one set of factors for every token.

    Hugging Face rotates a sequence by the short factors while it fits the pretraining length
    (`original_max_position_embeddings`) and, the step it grows past it, computes the whole sequence again
    with the long factors. A server that serves the longer context cannot recompute a request's cache as
    it crosses that length, and rotating some tokens of a step by other factors than the rest would make a
    token's output depend on what shares its step (and its keys disagree with later queries): here every
    token takes the long factors where the model's context exceeds the pretraining length, as Hugging Face
    does for any sequence longer than it; a shorter sequence gets the short factors in Hugging Face."""

    inv_freq: torch.Tensor
    scaling: float

    @classmethod
    def of(cls, rotary_emb: torch.nn.Module) -> LongRope:
        """The factors of the model's Hugging Face rotary module, whose rope_type is "longrope"."""
        config = rotary_emb.config
        original_max = config.rope_parameters["original_max_position_embeddings"]
        inv_freq = rotary_emb.original_inv_freq
        if config.max_position_embeddings > original_max:
            inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, inv_freq.device, seq_len=original_max + 1)
        return cls(inv_freq.float(), rotary_emb.attention_scaling)

    def at(self, hidden: torch.Tensor, positions: torch.Tensor) -> Rotary:
        freqs = positions[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos() * self.scaling, angles.sin() * self.scaling
        return Rotary(cos.to(hidden.dtype).unsqueeze(1), sin.to(hidden.dtype).unsqueeze(1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True, slots=True)
class LayerOps:
    """One forward's way to run a layer's parts: each linear layer, norm and mixture-of-experts block on
    its replacement where it has one (the batch-invariant kernels, or int4 copies for a small step) else
    on torch's modules, and attention over the paged cache with the step's metadata."""

    linears: Mapping[torch.nn.Module, Replacement]
    norms: Mapping[torch.nn.Module, Replacement]
    kv_cache: KVCache
    meta: AttentionMetadata
    experts: Mapping[torch.nn.Module, ExpertsKernel]

    def project(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        replaced = self.linears.get(linear)
        return linear(x) if replaced is None else replaced(x)

    def normalize(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        replaced = self.norms.get(norm)
        return norm(x) if replaced is None else replaced(x)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, hd], k/v [T, KVH, hd] of layer `layer` → [T, H, hd]; stores k/v in the cache first.
        The variants (a sliding window, soft-capped scores, sinks) are paged_attention's, off by default."""
        key, value = self.kv_cache.key[layer], self.kv_cache.value[layer]
        return paged_attention(q, k, v, key, value, self.meta, scale, window, softcap, sinks)


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


def self_attention(
    ops: LayerOps,
    layer: int,
    attn: torch.nn.Module,
    x: torch.Tensor,
    rotary: Rotary | None,
    shape: AttentionShape,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Llama's attention block over x [T, hidden]: separate q/k/v projections, per-head RMSNorm of q and k
    where the module has them (Qwen3, Gemma 3), rotary unless `rotary` is None, and the output projection.
    `window` and `softcap`: the attention variants of LayerOps.attend, off by default."""
    num_tokens = x.shape[0]
    q = ops.project(attn.q_proj, x).view(num_tokens, shape.num_heads, shape.head_dim)
    k = ops.project(attn.k_proj, x).view(num_tokens, shape.num_kv_heads, shape.head_dim)
    v = ops.project(attn.v_proj, x).view(num_tokens, shape.num_kv_heads, shape.head_dim)
    if hasattr(attn, "q_norm"):
        q, k = ops.normalize(attn.q_norm, q), ops.normalize(attn.k_norm, k)
    if rotary is not None:
        q, k = rotary.apply(q), rotary.apply(k)
    o = ops.attend(layer, q, k, v, shape.scale, window, softcap)
    return ops.project(attn.o_proj, o.view(num_tokens, -1))


def attention_heads(
    ops: LayerOps,
    layer: int,
    attn: torch.nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary: Rotary | None,
    shape: AttentionShape,
    window: int = 0,
) -> torch.Tensor:
    """An attention block from its projections q [T, H * hd] and k/v [T, KVH * hd], for families that project
    or normalize them otherwise than self_attention does (fused q/k/v, a norm over the whole projection):
    split into heads, rotary unless `rotary` is None, paged attention (within a sliding `window`, 0 for
    none) and the output projection."""
    num_tokens = q.shape[0]
    q = q.view(num_tokens, shape.num_heads, shape.head_dim)
    k = k.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    v = v.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    if rotary is not None:
        q, k = rotary.apply(q), rotary.apply(k)
    o = ops.attend(layer, q, k, v, shape.scale, window)
    return ops.project(attn.o_proj, o.view(num_tokens, -1))


def gated_mlp(ops: LayerOps, mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), Llama's MLP."""
    return ops.project(mlp.down_proj, mlp.act_fn(ops.project(mlp.gate_proj, x)) * ops.project(mlp.up_proj, x))
