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
from enum import IntEnum

import torch

# Columns per block of PackedLinear.with_block_max: the sampler's block (kBlock in sampling.cpp).
BLOCK = 256


class WeightForm(IntEnum):
    """How a packed weight stores its values (Form in invariant.cpp). Each widens in registers to exactly
    the float32 values its source converts to, so the kernel gives the float32 kernel's bits over any."""

    F32 = 0
    BF16 = 1
    # GGUF blocks of 32 weights along K: w = d * q (int8 q; 5-bit less 16 for Q5_0) and w = d * q + m (4-bit q;
    # 5-bit for Q5_1), d and m fp16.
    Q8_0 = 2
    Q4_1 = 3
    # GGUF's k-quants, super-blocks of 256 weights along K: w = (d * sc) * q - (dmin * m) (4-bit q, or 5-bit
    # for Q5_K, 6-bit sc and m per 32 weights) and w = (d * sc) * q (6-bit q, int8 sc per 16 weights), d and
    # dmin fp16.
    Q4_K = 4
    Q6_K = 5
    Q5_K = 6
    Q5_0 = 7
    Q5_1 = 8
    # GGUF's Q2_K: super-blocks of 256 weights, w = (d * sc) * q - (dmin * m) with 2-bit q and 4-bit sc and m per
    # 16 weights (Q4_K's arithmetic).
    Q2_K = 9
    # Q8_0's blocks with float32 d: no GGUF type, the form that GGUF types whose weights are a small integer times
    # a per-32 scale fp16 cannot hold are rewritten as (engine/model/gguf_transcode.py's TRANSCODED names them).
    Q8_F32 = 10
    # Q8_F32's with a scale per 16 weights: the form of the GGUF types whose scales are per 16 weights.
    Q8_F32_16 = 11
    # 16-bit floats, widened exactly (a float16 checkpoint's, or a GGUF's F16 tensors).
    F16 = 12


# A GGUF block's weights along K and its bytes, per form.
BLOCK_WEIGHTS = {
    WeightForm.Q8_0: 32,
    WeightForm.Q4_1: 32,
    WeightForm.Q5_0: 32,
    WeightForm.Q5_1: 32,
    WeightForm.Q4_K: 256,
    WeightForm.Q5_K: 256,
    WeightForm.Q6_K: 256,
    WeightForm.Q2_K: 256,
    WeightForm.Q8_F32: 32,
    WeightForm.Q8_F32_16: 16,
}
BLOCK_BYTES = {
    WeightForm.Q8_0: 34,
    WeightForm.Q4_1: 20,
    WeightForm.Q5_0: 22,
    WeightForm.Q5_1: 24,
    WeightForm.Q4_K: 144,
    WeightForm.Q5_K: 176,
    WeightForm.Q6_K: 210,
    WeightForm.Q2_K: 84,
    WeightForm.Q8_F32: 36,
    WeightForm.Q8_F32_16: 20,
}
# Where a GGUF block keeps its fp16 values: d (Q8_0, Q5_0); d then m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K); d at its
# end (Q6_K), d then dmin at their end (Q2_K). Q8_F32 and Q8_F32_16 have none: their d is a float32, the block's
# first 4 bytes.
SCALE_BYTES = {
    WeightForm.Q8_0: slice(0, 2),
    WeightForm.Q4_1: slice(0, 4),
    WeightForm.Q5_0: slice(0, 2),
    WeightForm.Q5_1: slice(0, 4),
    WeightForm.Q4_K: slice(0, 4),
    WeightForm.Q5_K: slice(0, 4),
    WeightForm.Q6_K: slice(208, 210),
    WeightForm.Q2_K: slice(80, 84),
}

# The forms of whole floating-point weights, and the torch dtype each holds.
FLOAT_DTYPES = {WeightForm.F32: torch.float32, WeightForm.BF16: torch.bfloat16, WeightForm.F16: torch.float16}
_FLOAT_FORMS = {dtype: form for form, dtype in FLOAT_DTYPES.items()}


def narrowest(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in the narrowest floating-point dtype that holds every one of its values bit for bit (so the kernel
    widens them back to the same float32): bfloat16 (a bfloat16 checkpoint's), else float16 (a float16 one's, a
    GGUF's F16 tensors'), else float32. Where both 16-bit dtypes hold them, either is exact at the same bytes."""
    weight = weight.detach()
    bits = weight.float().view(torch.int32)
    for dtype in (torch.bfloat16, torch.float16):
        narrow = weight.to(dtype)
        if torch.equal(narrow.float().view(torch.int32), bits):
            return narrow
    return weight.float()


# The KV cache dtypes the attention kernel reads, widening each element exactly (CacheDtype in invariant.h).
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class PackedLinear:
    """A linear layer's weight in one of the WeightForms, laid out in 16-column panels for sl_linear, and
    its float32 bias if it has one (added to each row on its own, so rows stay independent). `scalar` runs
    the kernel's portable variant, whose bits are the vector one's."""

    library: ctypes.CDLL
    panels: torch.Tensor
    out_features: int
    in_features: int
    form: WeightForm = WeightForm.F32
    scalar: bool = False
    bias: torch.Tensor | None = None

    @classmethod
    def pack(cls, library: ctypes.CDLL, weight: torch.Tensor) -> PackedLinear:
        """A float32, bfloat16 or float16 weight [N, K], kept in its own precision (any other dtype: as
        float32)."""
        weight = weight.detach().contiguous()
        if weight.dtype not in _FLOAT_FORMS:
            weight = weight.float()
        form = _FLOAT_FORMS[weight.dtype]
        return cls._packed(library, form, weight, *weight.shape)

    @classmethod
    def pack_blocks(
        cls, library: ctypes.CDLL, form: WeightForm, blocks: torch.Tensor, out_features: int, in_features: int
    ) -> PackedLinear:
        """A weight [N, K] as GGUF blocks of `form`: uint8 [N, K / BLOCK_WEIGHTS[form] * BLOCK_BYTES[form]], each
        row's blocks in k order."""
        per_row = in_features // BLOCK_WEIGHTS[form] * BLOCK_BYTES[form]
        if in_features % BLOCK_WEIGHTS[form] or blocks.shape != (out_features, per_row):
            raise ValueError(f"{form.name} blocks of shape {tuple(blocks.shape)} for a [{out_features}, {in_features}]")
        return cls._packed(library, form, blocks.contiguous(), out_features, in_features)

    @classmethod
    def _packed(
        cls, library: ctypes.CDLL, form: WeightForm, source: torch.Tensor, out_features: int, in_features: int
    ) -> PackedLinear:
        panels = torch.empty(library.sl_packed_bytes(form, out_features, in_features), dtype=torch.uint8)
        library.sl_pack(form, source.data_ptr(), out_features, in_features, panels.data_ptr())
        return cls(library, panels, out_features, in_features, form)

    def unpacked(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernel computes with: the values it widens its form to."""
        weight = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        self.library.sl_unpack(
            self.form, self.panels.data_ptr(), self.out_features, self.in_features, weight.data_ptr()
        )
        return weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

    def with_block_max(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output, and the largest value of each BLOCK-column block of each of its rows
        [..., ceil(out_features / BLOCK)], found while the kernel still holds them in cache (for an
        output head: the sampler then never reads a whole row of logits for its max). Bias-free layers only."""
        if self.bias is not None:
            raise ValueError("the block maxima are of the product before the bias")
        maxima = torch.empty(*x.shape[:-1], -(-self.out_features // BLOCK), dtype=torch.float32)
        return self._run(x, maxima), maxima

    def _run(self, x: torch.Tensor, maxima: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        self.library.sl_linear(
            self.form,
            self.scalar,
            rows.data_ptr(),
            rows.shape[0],
            self.in_features,
            self.panels.data_ptr(),
            self.out_features,
            out.data_ptr(),
            None if maxima is None else maxima.data_ptr(),
        )
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


class PackedEmbedding(torch.nn.Module):
    """An input embedding read from its tied output head's packed weight, whose row n is token n's: the same
    float32 values where the head's form widens exactly to the weight (the loader keeps no other), without a
    float32 copy of the table beside the packed one."""

    def __init__(self, head: PackedLinear) -> None:
        super().__init__()
        self.head = head
        self.num_embeddings = head.out_features
        self.embedding_dim = head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.embedding_dim, dtype=torch.float32)
        head = self.head
        found = head.library.sl_unpack_rows(
            head.form,
            head.panels.data_ptr(),
            head.out_features,
            head.in_features,
            ids.data_ptr(),
            ids.numel(),
            out.data_ptr(),
        )
        if found < 0:
            raise IndexError(f"a token id outside the vocabulary of {self.num_embeddings}")
        return out.view(*input_ids.shape, self.embedding_dim)


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
    # [T] one past the last key each token reads where some read past themselves (an image's tokens that
    # see their whole image); None: context_lens.
    key_ends: torch.Tensor | None = None


def invariant_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: KernelAttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] over the cached keys and values [slots, KVH, D] of one of CACHE_DTYPES (this step's already
    written). `window` > 0: a query at position p reads keys (p - window, p] only (up to its key end where
    meta.key_ends gives one); `softcap` > 0: scores become
    softcap * tanh(score / softcap); `sinks` [H] float32: a logit per head that joins each softmax's
    denominator with no value."""
    q = q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    meta.library.sl_paged_attention(
        q.data_ptr(),
        num_tokens,
        num_heads,
        head_dim,
        CACHE_DTYPES[k_cache.dtype],
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[1],
        meta.block_tables.data_ptr(),
        meta.block_tables.shape[1],
        meta.block_size,
        meta.table_rows.data_ptr(),
        meta.context_lens.data_ptr(),
        None if meta.key_ends is None else meta.key_ends.data_ptr(),
        scale,
        window,
        softcap,
        None if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
    )
    return out
