"""Batch-invariant linear layers and paged attention: a token's numbers depend on that token's
inputs alone, not on the batch it is computed in.

torch's CPU kernels pick their reduction order by shape (MKL computes a row alone, in a batch of
four and in a batch of sixteen three different ways), so the same request gave different bits
alone, next to others, chunked or read from the prefix cache. These kernels fix the order: a
linear layer's output element is one chain over k; an attention output is one pass over the
request's own keys, the same for a decode, a prompt chunk or a speculative verification.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

# Columns per block of PackedLinear.with_block_max: the sampler's block (kBlock in sampling.cpp).
BLOCK = 256


@dataclass(frozen=True)
class PackedLinear:
    """A bias-free linear layer's float32 weight, laid out in 16-column panels for sl_linear."""

    library: ctypes.CDLL
    panels: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, library: ctypes.CDLL, weight: torch.Tensor) -> PackedLinear:
        out_features, in_features = weight.shape
        weight = weight.detach().float().contiguous()
        panels = torch.empty(-(-out_features // 16) * 16 * in_features, dtype=torch.float32)
        library.sl_pack_weight(weight.data_ptr(), out_features, in_features, panels.data_ptr())
        return cls(library, panels, out_features, in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

    def with_block_max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output, and the largest value of each BLOCK-column block of each of its rows
        [..., ceil(out_features / BLOCK)], found while the kernel still holds them in cache (for an
        output head: the sampler then never reads a whole row of logits for its max)."""
        maxima = torch.empty(*x.shape[:-1], -(-self.out_features // BLOCK), dtype=torch.float32)
        return self._run(x, maxima), maxima

    def _run(self, x: torch.Tensor, maxima: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        self.library.sl_linear(
            rows.data_ptr(),
            rows.shape[0],
            self.in_features,
            self.panels.data_ptr(),
            self.out_features,
            out.data_ptr(),
            None if maxima is None else maxima.data_ptr(),
        )
        return out.view(*x.shape[:-1], self.out_features)


@dataclass
class KernelAttentionMetadata:
    """Which keys each query token reads, for sl_paged_attention in `library`."""

    library: ctypes.CDLL
    # [R, W] block table of each request in the step, padded with block 0.
    block_tables: torch.Tensor
    # [T] row of block_tables that holds each token's request.
    table_rows: torch.Tensor
    # [T] keys each token attends to: its own position + 1.
    context_lens: torch.Tensor
    block_size: int


def invariant_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: KernelAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D] over the cached keys and values [slots, KVH, D] (this step's already written)."""
    q = q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    meta.library.sl_paged_attention(
        q.data_ptr(),
        num_tokens,
        num_heads,
        head_dim,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[1],
        meta.block_tables.data_ptr(),
        meta.block_tables.shape[1],
        meta.block_size,
        meta.table_rows.data_ptr(),
        meta.context_lens.data_ptr(),
        scale,
        out.data_ptr(),
    )
    return out
