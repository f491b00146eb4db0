"""The building blocks the model families are made of: a step's linear layers, norms, experts and paged
attention (`LayerOps`, which picks the kernel each runs on), rotary embeddings, self-attention and the
gated MLP (the mixture-of-experts block is engine/model/moe.py).

A family (engine/model/families/) composes these into its decoder layer; nothing here knows a family."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.kv_cache import KVCache
from engine.model.attention.paged import AttentionMetadata, paged_attention

# What a linear layer or norm runs on instead of torch's module: a kernel's packed copy of its weights.
Replacement = Callable[[torch.Tensor], torch.Tensor]
# What linear layers over one input run on together: one kernel over their stacked weights, x → each one's output.
GroupReplacement = Callable[[torch.Tensor], Sequence[torch.Tensor]]


@dataclass(frozen=True)
class Fusions:
    """Kernels that do in one launch what several of torch's ops do, each giving the unfused path's bits
    (the GPU's, engine/kernels/gpu/; none elsewhere): a decode step of a small model is mostly
    launches, so each launch saved is time saved.

    `groups`: linear layers over one input (q/k/v, gate/up) by their tuple; `add_norms`: norms that add
    the residual stream's update in the same launch, (residual, delta) → (their sum, its norm);
    `gated`: activation modules whose act(gate) * up runs in one launch, (gate, up) → the product;
    `rotary_and_store`: q and k rotated, k and v written into the cache (engine/kernels/gpu/rotary.py's
    signature), used where the attention reads keys from the cache alone."""

    groups: Mapping[tuple[torch.nn.Module, ...], GroupReplacement] = field(default_factory=dict)
    add_norms: Mapping[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = (
        field(default_factory=dict)
    )
    gated: Mapping[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    rotary_and_store: Callable[..., torch.Tensor] | None = None


NO_FUSIONS = Fusions()


class ExpertsKernel(Protocol):
    """What a mixture-of-experts block runs on instead of torch's kernels: its router and experts on
    kernels of their own (engine/model/moe.py), x [T, H] → the sum of each token's top_k experts'
    outputs weighted by their routing weights (`routing`, a moe.Routing); `gate` turns a gate-up output
    into the down projection's input (the family's activation)."""

    def __call__(
        self, x: torch.Tensor, top_k: int, routing: int, gate: Callable[[torch.Tensor], torch.Tensor]
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
    its replacement where it has one (the batch-invariant kernels) else on torch's modules, attention over the
    paged cache with the step's metadata, and the fused kernels where the step has them."""

    linears: Mapping[torch.nn.Module, Replacement]
    norms: Mapping[torch.nn.Module, Replacement]
    kv_cache: KVCache
    meta: AttentionMetadata
    experts: Mapping[torch.nn.Module, ExpertsKernel]
    fusions: Fusions = NO_FUSIONS

    def project(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        replaced = self.linears.get(linear)
        return linear(x) if replaced is None else replaced(x)

    def project_all(self, linears: tuple[torch.nn.Module, ...], x: torch.Tensor) -> Sequence[torch.Tensor]:
        """Each of these linear layers over the same x: in one launch where they are fused."""
        group = self.fusions.groups.get(linears)
        if group is not None:
            return group(x)
        linear_map = self.linears
        return [linear(x) if (replaced := linear_map.get(linear)) is None else replaced(x) for linear in linears]

    def normalize(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        replaced = self.norms.get(norm)
        return norm(x) if replaced is None else replaced(x)

    def add_normalize(
        self, norm: torch.nn.Module, residual: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, norm of that sum): the residual stream's update and the next block's input."""
        fused = self.fusions.add_norms.get(norm)
        if fused is not None:
            return fused(residual, delta)
        residual = residual + delta
        replaced = self.norms.get(norm)
        return residual, norm(residual) if replaced is None else replaced(residual)

    def gate(self, act: torch.nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, the gated MLP's activation."""
        fused = self.fusions.gated.get(act)
        return act(gate) * up if fused is None else fused(gate, up)

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

    def rotate_and_attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: Rotary | None,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`attend` of q and k rotated by `rotary` (none where it is None): in one launch with the cache's
        write where the step has that kernel."""
        if rotary is None:
            return self.attend(layer, q, k, v, scale, window, softcap, sinks)
        fused = self.fusions.rotary_and_store
        if fused is None or not self.meta.reads_cache_only:
            return self.attend(layer, rotary.apply(q), rotary.apply(k), v, scale, window, softcap, sinks)
        key, value = self.kv_cache.key[layer], self.kv_cache.value[layer]
        meta = self.meta
        q = fused(q, k, v, rotary.cos, rotary.sin, key, value, meta.slot_mapping)
        return meta.attend(q, k, v, key, value, scale, window, softcap, sinks)


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Llama's attention block over x [T, hidden]: separate q/k/v projections, per-head RMSNorm of q and k
    where the module has them (Qwen3, Gemma 3), rotary unless `rotary` is None, and the output projection.
    `window`, `softcap` and `sinks`: the attention variants of LayerOps.attend, off by default."""
    num_tokens = x.shape[0]
    q, k, v = ops.project_all((attn.q_proj, attn.k_proj, attn.v_proj), x)
    q = q.view(num_tokens, shape.num_heads, shape.head_dim)
    k = k.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    v = v.view(num_tokens, shape.num_kv_heads, shape.head_dim)
    if hasattr(attn, "q_norm"):
        q, k = ops.normalize(attn.q_norm, q), ops.normalize(attn.k_norm, k)
    o = ops.rotate_and_attend(layer, q, k, v, rotary, shape.scale, window, softcap, sinks)
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
    o = ops.rotate_and_attend(layer, q, k, v, rotary, shape.scale, window)
    return ops.project(attn.o_proj, o.view(num_tokens, -1))


def gated_mlp(ops: LayerOps, mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), Llama's MLP."""
    gate, up = ops.project_all((mlp.gate_proj, mlp.up_proj), x)
    return ops.project(mlp.down_proj, ops.gate(mlp.act_fn, gate, up))
