"""ImageInput: an image of a prompt as the engine takes it: the vision tower's inputs for that image alone,
the prompt positions its embeddings fill, and the hash that names its content."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt. Its embedding rows fill, in order, the prompt positions of `runs`
    ((start, length) each, ascending): one run where the image's tokens are contiguous, several
    where the template writes text between its tiles (Idefics3's rows and columns)."""

    # Names the tower's inputs: equal hashes, equal embeddings (the encoder cache's and prefix cache's key).
    content_hash: int
    runs: tuple[tuple[int, int], ...]
    # The processor's outputs for this image alone, as the family's vision tower takes them.
    inputs: Mapping[str, torch.Tensor]

    @classmethod
    def of(cls, runs: tuple[tuple[int, int], ...], inputs: Mapping[str, torch.Tensor]) -> ImageInput:
        digest = hashlib.sha256()
        for name in sorted(inputs):
            tensor = inputs[name].contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        return cls(int.from_bytes(digest.digest()[:8], "little"), runs, dict(inputs))

    @property
    def num_rows(self) -> int:
        return sum(length for _, length in self.runs)

    @property
    def start(self) -> int:
        return self.runs[0][0]

    @property
    def end(self) -> int:
        """One past the last prompt position the image fills."""
        start, length = self.runs[-1]
        return start + length

    def fills(self, start: int, end: int) -> bool:
        """Whether the image fills a position in [start, end) (not only the text between its runs)."""
        return any(run_start < end and run_start + length > start for run_start, length in self.runs)

    def rows_in(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The image's rows that fill positions in [start, end): (first position, first row, count) each."""
        found, row = [], 0
        for run_start, length in self.runs:
            low, high = max(start, run_start), min(end, run_start + length)
            if low < high:
                found.append((low, row + low - run_start, high - low))
            row += length
        return found


def image_blocks(images: tuple[ImageInput, ...]) -> tuple[tuple[int, int], ...]:
    """The prompt ranges [start, end) whose tokens attend to each other both ways, for a model whose image
    tokens do (Gemma 3): each run of consecutive image positions, runs that touch merged (as Hugging Face
    groups its token_type_ids), in order."""
    blocks: list[tuple[int, int]] = []
    for start, length in sorted(run for image in images for run in image.runs):
        if blocks and blocks[-1][1] == start:
            blocks[-1] = (blocks[-1][0], start + length)
        else:
            blocks.append((start, start + length))
    return tuple(blocks)
