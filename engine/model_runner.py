"""ModelRunner: turns a StepPlan into ragged batch tensors, runs the forward, returns logits."""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.kv_cache import KVCache
from engine.model import PagedCausalLM
from engine.request import Request
from engine.scheduler import StepPlan


class ModelRunner:
    """Owns the KV storage and the only calls into the model."""

    def __init__(self, model: PagedCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.kv_cache = KVCache.allocate(
            num_layers=model.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.dtype,
            device=model.device,
        )

    def execute(self, plan: StepPlan) -> tuple[list[Request], torch.Tensor]:
        """Run one forward; return the requests that sample this step and their logits rows."""
        decodes = [(r, n) for r, n in plan.scheduled if n == 1]
        chunks = [(r, n) for r, n in plan.scheduled if n > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        samplers: list[Request] = []
        prefills: list[PrefillChunk] = []

        for request, num_new in decodes + chunks:
            start = request.num_computed_tokens
            end = start + num_new
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self._slots(request, start, end))
            if num_new > 1:
                prefills.append(self._prefill_chunk(request, len(input_ids) - num_new, start, end))
            if end == request.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                samplers.append(request)

        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=len(decodes),
            decode_slots=None,
            decode_mask=None,
            prefills=prefills,
        )
        if decodes:
            meta.decode_slots, meta.decode_mask = self._decode_context([r for r, _ in decodes])
        logits = self.model.forward(
            self._tensor(input_ids),
            self._tensor(positions),
            meta,
            self.kv_cache,
            self._tensor(logits_indices),
        )
        return samplers, logits

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy the K/V of whole blocks, (source, destination), in every layer."""
        if not copies:
            return
        offsets = torch.arange(self.block_size, device=self.device)
        sources, destinations = (self._tensor(list(blocks)) for blocks in zip(*copies))
        source_slots = (sources.unsqueeze(1) * self.block_size + offsets).flatten()
        destination_slots = (destinations.unsqueeze(1) * self.block_size + offsets).flatten()
        for storage in (self.kv_cache.key, self.kv_cache.value):
            storage[:, destination_slots] = storage[:, source_slots]

    def _slots(self, request: Request, start: int, end: int) -> list[int]:
        table, size = request.block_table, self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def _prefill_chunk(self, request: Request, batch_start: int, start: int, end: int) -> PrefillChunk:
        num_new = end - start
        if start == 0:
            return PrefillChunk(batch_start, num_new, context_slots=None, mask=None)
        context = self._tensor(self._slots(request, 0, end))
        query_pos = torch.arange(start, end, device=self.device).unsqueeze(1)
        mask = torch.arange(end, device=self.device).unsqueeze(0) <= query_pos
        return PrefillChunk(batch_start, num_new, context_slots=context, mask=mask)

    def _decode_context(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of every decode's context, padded to the longest, and the mask of real ones."""
        context_lens = [r.num_computed_tokens + 1 for r in requests]
        max_len = max(context_lens)
        max_blocks = -(-max_len // self.block_size)
        tables = self._tensor([(r.block_table + [0] * max_blocks)[:max_blocks] for r in requests])
        offsets = torch.arange(self.block_size, device=self.device)
        slots = (tables.unsqueeze(-1) * self.block_size + offsets).view(len(requests), -1)[:, :max_len]
        mask = torch.arange(max_len, device=self.device).unsqueeze(0) < self._tensor(context_lens).unsqueeze(1)
        return slots, mask.view(len(requests), 1, 1, max_len)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
