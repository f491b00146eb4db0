"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP tower whose patches are average-pooled to
`mm_tokens_per_image` rows and projected, over Gemma 3's text model. The processor writes each image as its
start-of-image token, that many image tokens and its end-of-image token (pan-and-scan adds a run per crop,
each as long); the image tokens of a run attend to each other both ways, as Hugging Face's token_type_ids
mask has them, which the scheduler and the attention provide (Request.image_blocks)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.images import ImageInput
from engine.model.families.vision import LanguagePart, VisionFamily


class Gemma3Vision(VisionFamily):
    model_types = ("gemma3",)
    bidirectional_images = True

    @property
    def longest_image_block(self) -> int:
        # Every run (the whole image's, each crop's) is as long.
        return int(self.hf_model.config.mm_tokens_per_image)

    def language(self) -> LanguagePart:
        # Hugging Face's vision-language Gemma 3 soft-caps no logits, whatever its text_config says.
        config = copy.copy(self.hf_model.config.text_config)
        config.final_logit_softcapping = None
        return LanguagePart(config, self.hf_model.model.language_model)

    def prompt(self, processor: Any, text: str, images: Sequence[Any]) -> tuple[list[int], tuple[ImageInput, ...]]:
        # The processor takes a list of images per prompt.
        return super().prompt(processor, text, [list(images)])

    def image_token(self, processor: Any) -> str:
        # The placeholder a prompt writes is the start-of-image token; what it becomes holds the image tokens.
        return processor.tokenizer.image_token

    def split(self, outputs: Mapping[str, torch.Tensor], num_rows: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Each image's pixel values (the whole image, then its pan-and-scan crops), `mm_tokens_per_image`
        image tokens each."""
        inputs = {name: value for name, value in outputs.items() if name not in self.text_outputs}
        rows_per_crop = self.hf_model.config.mm_tokens_per_image
        split, start = [], 0
        for rows in num_rows:
            count = rows // rows_per_crop
            split.append({name: value[start : start + count] for name, value in inputs.items()})
            start += count
        return split
