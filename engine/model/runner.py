"""ModelRunner: turns a StepPlan into ragged batch tensors, runs the forward, returns logits."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

import torch

from engine.encoder_cache import EncoderCache
from engine.images import ImageInput
from engine.kv_cache import KVCache
from engine.model.attention.invariant import InvariantMetadata
from engine.model.attention.paged import AttentionMetadata, image_key_ends
from engine.model.attention.torch_sdpa import TorchMetadata
from engine.model.attention.triton_paged import TritonMetadata, gpu_attention
from engine.model.causal_lm import HeadOutput, PagedCausalLM
from engine.model.graphs import DecodeGraphs, Replay, run_eagerly
from engine.model.image_embedder import ImageEmbedder
from engine.model.uploads import long_tensor
from engine.request import Request
from engine.rope_positions import RopePositions
from engine.scheduler import StepPlan

logger = logging.getLogger(__name__)


class Logits(Enum):
    NONE = 0
    LAST = 1
    ALL = 2


@dataclass(slots=True)
class Segment:
    """Consecutive tokens of one request computed in a forward, and which logits it wants.

    Not frozen: a step makes one per request, and a frozen dataclass's __init__ (a setattr per field)
    costs a measurable share of a step at hundreds of streams."""

    request: Request
    start: int
    token_ids: list[int]
    logits: Logits


class ModelRunner:
    """Owns the KV storage and the only calls into the model."""

    def __init__(
        self, model: PagedCausalLM, num_blocks: int, block_size: int, max_num_encoder_input_tokens: int = 0
    ) -> None:
        """`max_num_encoder_input_tokens`: the most rows of new images a step encodes (the scheduler's)."""
        self.model = model
        # A vision-language model's image embeddings (None for a text model: no work per step). The cache holds
        # at least a step's new images, as vLLM sizes its own: else they evict each other, and an image chunked
        # across steps is encoded again.
        cache_rows = max(1 << 14, max_num_encoder_input_tokens)
        self.images = ImageEmbedder(model.vision, EncoderCache(cache_rows)) if model.vision is not None else None
        # Whether requests' image blocks attend both ways (Request.image_blocks): each step then tells the
        # attention how far each of their tokens reads.
        self.whole_images = model.vision is not None and model.vision.bidirectional_images
        # Whether requests' tokens are rotated by their place in their image's grid (Request.rope_positions).
        self.rope_by_grid = model.vision is not None and model.vision.rope_by_grid
        self.block_size = block_size
        self.device = model.device
        # The GPU's paged attention kernels, where they run (else SDPA over gathered contexts).
        self.gpu_attention = gpu_attention(self.device, block_size, model.num_heads, model.num_kv_heads, model.head_dim)
        # Decode steps replayed as CUDA graphs, once captured (capture_decode_graphs).
        self.graphs: DecodeGraphs | None = None
        # With overlapped steps, the device buffer that placeholder token ids name (engine/future_tokens.py):
        # graphs captured with it resolve them themselves.
        self.placeholders: torch.Tensor | None = None
        # One block past the pool's: a graph's padding rows write and read there, and nothing else does.
        self.scratch_block = num_blocks
        self.kv_cache = KVCache.allocate(
            num_layers=model.num_layers,
            num_blocks=num_blocks + 1,
            block_size=block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=model.kv_dtype,
            device=model.device,
        )

    def capture_decode_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        eager: bool = False,
        capture: Callable[[Callable[[], HeadOutput]], Replay] | None = None,
    ) -> bool:
        """Capture decode steps of up to max_num_seqs requests as CUDA graphs (`eager`, --enforce-eager:
        graphs.run_eagerly runs them eagerly, padded alike; tests pass their own `capture`); whether they
        were: they need the GPU's paged decode kernel and a family whose forward
        a graph can replay."""
        model = self.model
        if self.gpu_attention is None or model.kernels is not None:
            logger.info("CUDA graphs off: they need the Triton paged decode kernel (a cache block of 16+)")
            return False
        if not model.family.graph_capturable:
            logger.info("CUDA graphs off: this model family's forward cannot be replayed as a graph")
            return False
        try:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                self.gpu_attention,
                self.block_size,
                self.scratch_block,
                max_num_seqs,
                max_model_len,
                capture or (run_eagerly if eager else None),
                self.placeholders,
            )
        except Exception as exc:
            if eager or capture is not None:
                raise
            message = "capturing the decode steps as CUDA graphs failed; --enforce-eager runs without them"
            raise RuntimeError(message) from exc
        if eager:
            logger.info("CUDA graphs off (--enforce-eager): decode steps run eagerly, padded to the graphs' buckets")
        return True

    def execute(
        self, plan: StepPlan, resolve: Callable[[torch.Tensor], None] | None = None
    ) -> tuple[list[Request], HeadOutput]:
        """Run one forward; return the requests that sample this step and their logits rows
        (one each, or one per proposal plus one for a request verifying proposals). `resolve`
        replaces on the device the placeholders of tokens an earlier step has not handed back yet
        (engine/future_tokens.py)."""
        segments: list[Segment] = []
        sampling_requests: list[Request] = []
        for request, num_new in sorted(plan.scheduled, key=lambda entry: entry[1] > 1):
            start = request.num_computed_tokens
            proposed = plan.proposals.get(request)
            if proposed:
                # Verification: the target's scores after the last token and after each proposal.
                segments.append(Segment(request, start, request.token_ids[start:] + proposed, Logits.ALL))
                sampling_requests.append(request)
            elif start + num_new == request.num_tokens:
                segments.append(Segment(request, start, request.token_ids[start : start + num_new], Logits.LAST))
                sampling_requests.append(request)
            else:
                segments.append(Segment(request, start, request.token_ids[start : start + num_new], Logits.NONE))
        return sampling_requests, self.run(segments, resolve)

    def run(self, segments: list[Segment], resolve: Callable[[torch.Tensor], None] | None = None) -> HeadOutput:
        """One forward over `segments` (single-token ones first); logits rows in segment order.

        Each segment's tokens sit at positions start, start + 1, ... of its request and
        attend to the request's cached K/V before `start`.
        """
        input_ids, positions, slots, logits_indices = array("q"), array("q"), array("q"), array("q")
        # Each token's segment: its row of the kernel's block tables, built here with the rest rather
        # than by torch.repeat_interleave over the segments' lengths, which costs more per step.
        segment_rows = array("q")
        size = self.block_size
        for row, segment in enumerate(segments):
            start, token_ids = segment.start, segment.token_ids
            if len(token_ids) == 1:
                # A decode, most of a step's segments at hundreds of streams: no ranges or lists for it.
                input_ids.append(token_ids[0])
                positions.append(start)
                segment_rows.append(row)
                slots.append(segment.request.block_table[start // size] * size + start % size)
                if segment.logits != Logits.NONE:
                    logits_indices.append(len(input_ids) - 1)
                continue
            end = start + len(token_ids)
            input_ids.extend(token_ids)
            positions.extend(range(start, end))
            segment_rows.extend([row] * len(token_ids))
            slots.extend(self._slots(segment.request, start, end))
            if segment.logits == Logits.ALL:
                logits_indices.extend(range(len(input_ids) - (end - start), len(input_ids)))
            elif segment.logits == Logits.LAST:
                logits_indices.append(len(input_ids) - 1)
        image_rows = self.images.rows(segments) if self.images is not None else None
        rope = self._rope_positions(segments) if self.rope_by_grid else None
        graphs = self.graphs
        # Decodes only (a token per segment), each wanting its logits: the captured graph of its size
        # (if it can read the placeholders among them).
        if (
            graphs is not None
            and image_rows is None
            and rope is None
            and 0 < len(segments) == len(input_ids) == len(logits_indices) <= graphs.max_batch
            and (resolve is None or graphs.placeholders is not None)
        ):
            tables = [segment.request.block_table for segment in segments]
            return graphs.replay(input_ids, positions, slots, tables)
        position_tensor = self._tensor(positions)
        slot_mapping = self._tensor(slots)
        key_ends = None
        if self.whole_images and (ends := image_key_ends(segments, positions)) is not None:
            key_ends = self._tensor(ends)
        meta: AttentionMetadata
        if self.model.kernels is not None:
            meta = InvariantMetadata.build(
                self.model.kernels, segments, slot_mapping, position_tensor, segment_rows, self.block_size, key_ends
            )
        elif self.gpu_attention is not None:
            meta = TritonMetadata.build(self.gpu_attention, segments, slot_mapping, self.block_size, key_ends)
        else:
            meta = TorchMetadata.build(segments, slot_mapping, self.block_size, key_ends)
        input_tensor = self._tensor(input_ids)
        if resolve is not None:
            resolve(input_tensor)
        return self.model.forward(
            input_tensor,
            position_tensor,
            meta,
            self.kv_cache,
            self._tensor(logits_indices),
            image_rows=image_rows,
            rope_positions=rope,
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy the K/V of whole blocks, (source, destination), in every layer."""
        if not copies:
            return
        offsets = torch.arange(self.block_size, device=self.device)
        sources, destinations = (self._tensor(blocks) for blocks in zip(*copies))
        source_slots = (sources.unsqueeze(1) * self.block_size + offsets).flatten()
        destination_slots = (destinations.unsqueeze(1) * self.block_size + offsets).flatten()
        for storage in (self.kv_cache.key, self.kv_cache.value):
            storage[:, destination_slots] = storage[:, source_slots]

    def rope_positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> RopePositions | None:
        """A new request's rotary positions, where the model rotates by grid (else None: its tokens' indices)."""
        vision = self.model.vision
        return vision.rope_positions(num_tokens, images) if vision is not None and self.rope_by_grid else None

    def _rope_positions(self, segments: list[Segment]) -> torch.Tensor | None:
        """[3, T]: each token's three rotary positions, where a request of the step has them (else None: every
        token's index, on each axis)."""
        if not any(segment.request.rope_positions is not None for segment in segments):
            return None
        axes = (array("q"), array("q"), array("q"))
        for segment in segments:
            start, end = segment.start, segment.start + len(segment.token_ids)
            positions = segment.request.rope_positions
            if positions is not None:
                positions.extend(start, end, axes)
            else:
                for axis in axes:
                    axis.extend(range(start, end))
        return self._tensor([*axes[0], *axes[1], *axes[2]]).view(3, -1)

    def _slots(self, request: Request, start: int, end: int) -> list[int]:
        table, size = request.block_table, self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def _tensor(self, values: Iterable[int]) -> torch.Tensor:
        return long_tensor(values, self.device)
