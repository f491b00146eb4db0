"""ImageEmbedder: a step's image embeddings, laid where the forward reads them; the vision tower runs here,
on the engine thread, before the forward whose prompt chunks hold an image's tokens."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.encoder_cache import EncoderCache
from engine.images import ImageInput
from engine.model.causal_lm import ImageRows
from engine.model.families.vision import VisionFamily

if TYPE_CHECKING:
    from engine.model.runner import Segment


class ImageEmbedder:
    """Finds the image tokens among a step's segments, takes their images' embeddings from the encoder cache
    or the tower, and returns the rows that replace those tokens' embeddings.

    A chunk of a prompt may hold part of an image (chunked prefill splits images as it splits text): it takes
    the rows of that part. Where the tower is on the batch-invariant kernels (VisionFamily.invariant_tower), a
    step's new images are encoded together, one tower call for each shape they come in (VisionFamily.batch_key):
    the tower's layers that mix images' rows run on those kernels, so an image's embeddings never depend on the
    other images of its call. On torch's kernels they would, so each image is encoded alone there (the
    determinism rule: alone == in a batch == from the cache)."""

    def __init__(self, vision: VisionFamily, cache: EncoderCache) -> None:
        self.vision = vision
        self.cache = cache
        # Images encoded, the tower calls that encoded them, and their seconds: the vision tower's share of the
        # engine thread's time.
        self.num_encoded = 0
        self.num_calls = 0
        self.seconds = 0.0

    def rows(self, segments: Sequence[Segment]) -> ImageRows | None:
        """The image rows of a forward over `segments` (laid out in order), or None when it holds no image token."""
        placements: list[tuple[int, ImageInput, int, int]] = []
        offset = 0
        for segment in segments:
            request, start, count = segment.request, segment.start, len(segment.token_ids)
            if request.images and start < request.num_prompt_tokens:
                end = start + count
                for image in request.images:
                    if image.start < end and image.end > start:
                        for position, row, num_rows in image.rows_in(start, end):
                            placements.append((offset + position - start, image, row, num_rows))
            offset += count
        if not placements:
            return None
        # An image counts in the cache's hit rate where a request starts on its tokens.
        starting = Counter(image.content_hash for _, image, row, _ in placements if row == 0)
        embeddings = self._embeddings({image.content_hash: image for _, image, _, _ in placements}.values(), starting)
        indices = torch.cat([torch.arange(at, at + n) for at, _, _, n in placements])
        rows = torch.cat([embeddings[image.content_hash][row : row + n] for _, image, row, n in placements])
        return ImageRows(indices.to(rows.device), rows)

    def _embeddings(self, images: Iterable[ImageInput], starting: Counter[int]) -> dict[int, torch.Tensor]:
        """Each image's embeddings, held for this step (the cache may drop them meanwhile)."""
        found: dict[int, torch.Tensor] = {}
        batches: dict[object, list[ImageInput]] = {}
        batched = self.vision.invariant_tower
        # Every lookup before the first put: a put may drop an image this step reads.
        for image in images:
            embeddings = self.cache.get(image.content_hash, starting[image.content_hash])
            if embeddings is None:
                key = self.vision.batch_key(image.inputs) if batched else image.content_hash
                batches.setdefault(key, []).append(image)
            else:
                found[image.content_hash] = embeddings
        for batch in batches.values():
            started = time.perf_counter()
            encoded = self.vision.encode_batch([image.inputs for image in batch], [image.num_rows for image in batch])
            self.seconds += time.perf_counter() - started
            self.num_calls += 1
            self.num_encoded += len(batch)
            for image, embeddings in zip(batch, encoded):
                self.cache.put(image.content_hash, embeddings)
                found[image.content_hash] = embeddings
        return found
