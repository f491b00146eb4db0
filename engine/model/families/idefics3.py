"""Idefics3 and SmolVLM (256M, 500M, 2.2B): a SigLIP tower and a pixel-shuffle connector over a Llama. The
processor splits an image into tiles plus the whole image shrunk (`do_image_splitting`), each a run of
`image_seq_len` image tokens between the template's row and column tags: an image is several runs, its
tiles' rows in the order the runs come."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.images import ImageInput
from engine.model.families.vision import LanguagePart, VisionFamily


class Idefics3(VisionFamily):
    model_types = ("idefics3",)
    # pixel_values [1, tiles, 3, H, W] and pixel_attention_mask [1, tiles, H, W]: the tower flattens the tiles.
    image_dim = 1

    def language(self) -> LanguagePart:
        return LanguagePart(self.hf_model.config.text_config, self.hf_model.model.text_model)

    def prompt(self, processor: Any, text: str, images: Sequence[Any]) -> tuple[list[int], tuple[ImageInput, ...]]:
        # The processor takes a list of images per prompt.
        return super().prompt(processor, text, [list(images)])

    def batch_key(self, inputs: Mapping[str, torch.Tensor]) -> tuple:
        # transformers' tower drops its attention mask only where the whole call's pixel_attention_mask is all
        # true (then another attention kernel runs): a padded tile's image stacked with others would change theirs.
        mask = inputs.get("pixel_attention_mask")
        return (*super().batch_key(inputs), mask is None or bool(mask.all()))

    def split(self, outputs: Mapping[str, torch.Tensor], num_rows: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Each image's tiles (its grid's, then the whole image's) out of the prompt's, stacked on dim 1: as
        many as its image tokens make (each tile is as many tokens)."""
        inputs = {name: value for name, value in outputs.items() if name not in self.text_outputs}
        rows_per_tile = sum(num_rows) // inputs["pixel_values"].shape[1]
        split, start = [], 0
        for rows in num_rows:
            count = rows // rows_per_tile
            split.append({name: value[:, start : start + count] for name, value in inputs.items()})
            start += count
        return split
