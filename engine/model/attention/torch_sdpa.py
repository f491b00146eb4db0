"""torch's SDPA backend: decodes batched over their gathered, padded contexts, a call per prefill chunk;
the attention variants (window, soft-capping, sinks) through explicit masks, as transformers computes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from engine.model.attention.block_tables import table_tensor
from engine.model.uploads import long_tensor

if TYPE_CHECKING:
    from engine.model.runner import Segment


@dataclass(frozen=True)
class PrefillChunk:
    """One request's multi-token slice of the batch."""

    # First token of the chunk in the batch.
    start: int
    # Tokens the chunk computes this step.
    num_tokens: int
    # Cache slots of the whole context (cached tokens, then this chunk), or None when
    # nothing was cached before the chunk and the chunk's own K/V are the context.
    context_slots: torch.Tensor | None
    # [num_tokens, context_len] causal mask shifted past the cached tokens (keys before each token's end where
    # key_ends is given); None for a causal chunk with nothing cached.
    mask: torch.Tensor | None
    # [num_tokens] one past the last key each token reads, where some read past themselves (image blocks).
    key_ends: torch.Tensor | None = None


@dataclass(frozen=True)
class TorchMetadata:
    """torch's SDPA: the decodes in one batched call over their contexts gathered and padded, and a
    causal call per prefill chunk."""

    # [T] cache slot that receives each token's K/V.
    slot_mapping: torch.Tensor
    # Decodes are tokens [0, num_decode_tokens) of the batch.
    num_decode_tokens: int
    # A prompt chunk with nothing cached reads its own k and v, not the cache's.
    reads_cache_only: ClassVar[bool] = False
    # [D, L] slots each decode reads, padded to the longest context L; None without decodes.
    decode_slots: torch.Tensor | None
    # [D, 1, 1, L] True for slots inside each decode's context.
    decode_mask: torch.Tensor | None
    # [D, 1, 1, 1] keys each decode attends to, for a sliding window's mask; None without decodes.
    decode_lens: torch.Tensor | None
    prefills: tuple[PrefillChunk, ...]

    @classmethod
    def build(
        cls,
        segments: Sequence[Segment],
        slot_mapping: torch.Tensor,
        block_size: int,
        key_ends: torch.Tensor | None = None,
    ) -> TorchMetadata:
        """`key_ends` [T]: one past the last key each token reads, where a step's image blocks read past
        themselves (image_key_ends); None for causal attention throughout."""
        device = slot_mapping.device
        prefills = []
        offset = 0
        for segment in segments:
            num_new = len(segment.token_ids)
            if num_new > 1:
                ends = None if key_ends is None else key_ends[offset : offset + num_new]
                prefills.append(_prefill_chunk(segment, offset, block_size, device, ends))
            offset += num_new
        decodes = [segment for segment in segments if len(segment.token_ids) == 1]
        decode_slots = decode_mask = decode_lens = None
        if decodes:
            decode_slots, decode_mask, decode_lens = _decode_context(decodes, block_size, device)
        return cls(slot_mapping, len(decodes), decode_slots, decode_mask, decode_lens, tuple(prefills))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window or softcap or sinks is not None:
            return self._attend_variant(q, k, v, k_cache, v_cache, scale, window, softcap, sinks)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        out = torch.empty_like(q)
        num_decodes = self.num_decode_tokens
        if num_decodes:
            # Grouped-query attention without copying K/V: the query heads that share a
            # KV head sit on the "query length" axis of one SDPA call.
            group = num_heads // num_kv_heads
            qd = q[:num_decodes].view(num_decodes, num_kv_heads, group, head_dim)
            kd = k_cache[self.decode_slots].transpose(1, 2)
            vd = v_cache[self.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, scale=scale)
            out[:num_decodes] = od.reshape(num_decodes, num_heads, head_dim)
        for chunk in self.prefills:
            end = chunk.start + chunk.num_tokens
            qc = q[chunk.start : end].transpose(0, 1)
            if chunk.context_slots is None:
                kc, vc = k[chunk.start : end], v[chunk.start : end]
            else:
                kc, vc = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
            oc = F.scaled_dot_product_attention(
                qc,
                kc.transpose(0, 1),
                vc.transpose(0, 1),
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[chunk.start : end] = oc.transpose(0, 1)
        return out

    def _attend_variant(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """`attend` with a sliding window, soft-capped scores or sinks: the same calls, each with an
        explicit mask, on `masked_attention`."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        num_decodes = self.num_decode_tokens
        if num_decodes:
            qd = q[:num_decodes].view(num_decodes, num_kv_heads, group, head_dim)
            kd = k_cache[self.decode_slots].transpose(1, 2)
            vd = v_cache[self.decode_slots].transpose(1, 2)
            mask = self.decode_mask
            if window:
                keys = torch.arange(mask.shape[-1], device=q.device)
                mask = mask & (keys >= self.decode_lens - window)
            head_sinks = None if sinks is None else sinks.view(num_kv_heads, group, 1)
            od = masked_attention(qd, kd, vd, mask, scale, softcap, head_sinks)
            out[:num_decodes] = od.reshape(num_decodes, num_heads, head_dim)
        for chunk in self.prefills:
            end = chunk.start + chunk.num_tokens
            if chunk.context_slots is None:
                kc, vc = k[chunk.start : end], v[chunk.start : end]
            else:
                kc, vc = k_cache[chunk.context_slots], v_cache[chunk.context_slots]
            context_len = kc.shape[0]
            keys = torch.arange(context_len, device=q.device)
            queries = torch.arange(context_len - chunk.num_tokens, context_len, device=q.device).unsqueeze(1)
            mask = keys <= queries if chunk.key_ends is None else keys < chunk.key_ends.unsqueeze(1)
            if window:
                mask = mask & (keys > queries - window)
            qc = q[chunk.start : end].transpose(0, 1)
            kc = kc.transpose(0, 1).repeat_interleave(group, 0)
            vc = vc.transpose(0, 1).repeat_interleave(group, 0)
            head_sinks = None if sinks is None else sinks.view(num_heads, 1, 1)
            out[chunk.start : end] = masked_attention(qc, kc, vc, mask, scale, softcap, head_sinks).transpose(0, 1)
        return out


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention of q [..., M, hd] over k, v [..., N, hd] where `mask` [..., M, N] is True, as
    transformers computes the variants: SDPA for a window alone, else scores soft-capped, masked, the
    sinks (broadcast to [..., M, 1]) appended as one more logit per row, softmax, and their column dropped."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, sink_column), dim=-1)
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if sinks is not None:
        weights = weights[..., :-1]
    return weights @ v


def _prefill_chunk(
    segment: Segment, batch_start: int, block_size: int, device: torch.device, key_ends: torch.Tensor | None
) -> PrefillChunk:
    start, num_new = segment.start, len(segment.token_ids)
    end = start + num_new
    keys = torch.arange(end, device=device).unsqueeze(0)
    if key_ends is not None:
        mask = keys < key_ends.unsqueeze(1)
    elif start == 0:
        return PrefillChunk(batch_start, num_new, context_slots=None, mask=None)
    else:
        mask = keys <= torch.arange(start, end, device=device).unsqueeze(1)
    if start == 0:
        # Nothing cached before the chunk: its own k and v are the context.
        return PrefillChunk(batch_start, num_new, context_slots=None, mask=mask, key_ends=key_ends)
    table = segment.request.block_table
    context = long_tensor([table[p // block_size] * block_size + p % block_size for p in range(end)], device)
    return PrefillChunk(batch_start, num_new, context_slots=context, mask=mask, key_ends=key_ends)


def _decode_context(
    decodes: Sequence[Segment], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots of every decode's context, padded to the longest, the mask of real ones and the contexts'
    lengths [D, 1, 1, 1]."""
    context_lens = [segment.start + 1 for segment in decodes]
    max_len = max(context_lens)
    max_blocks = -(-max_len // block_size)
    tables = table_tensor([segment.request.block_table for segment in decodes], max_blocks, device)
    offsets = torch.arange(block_size, device=device)
    slots = (tables.unsqueeze(-1) * block_size + offsets).view(len(decodes), -1)[:, :max_len]
    lens = long_tensor(context_lens, device).view(len(decodes), 1, 1, 1)
    mask = torch.arange(max_len, device=device) < lens
    return slots, mask, lens
