"""EncoderBudget: how much new vision-tower work a step may start, as vLLM's max_num_encoder_input_tokens bounds it."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class EncoderBudget:
    """One step's room for images the tower must encode: those a chunk reaches that are not in the encoder
    cache, `num_rows` embedding rows of them at most (an image costs as many rows as it has tokens). Cached
    images, and images another chunk of the step already starts, cost nothing. The step's first new image
    starts whatever its size, so an image larger than the budget is still encoded (alone in its step)."""

    # The content hashes of the images whose embeddings the encoder cache holds (EncoderCache).
    cache: Container[int]
    # Rows left to start this step.
    num_rows: int
    # The images this step encodes, by content hash.
    started: set[int] = field(default_factory=set)

    def fit(self, request: Request, start: int, num_new: int) -> int:
        """How many of the `num_new` tokens from `start` a chunk of `request` computes so that the new images
        it reaches fit the room left: cut back to the start of the first that does not (0 where that image
        began before `start`, its embeddings dropped since: the chunk waits for a step with room)."""
        end = start + num_new
        if start >= request.num_prompt_tokens:
            return num_new  # decoding: images are in the prompt
        room, taken = self.num_rows, set(self.started)
        for image in request.images:
            content = image.content_hash
            if content in taken or content in self.cache or not image.fills(start, end):
                continue
            if image.num_rows > room and taken:
                return max(0, image.start - start)
            room -= image.num_rows
            taken.add(content)
        return num_new

    def charge(self, request: Request, start: int, num_new: int) -> None:
        """Count the new images a scheduled chunk of `num_new` tokens from `start` reaches."""
        end = start + num_new
        if start >= request.num_prompt_tokens:
            return
        for image in request.images:
            content = image.content_hash
            if content not in self.started and content not in self.cache and image.fills(start, end):
                self.started.add(content)
                self.num_rows -= image.num_rows
