"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP tower whose patches are average-pooled to
`mm_tokens_per_image` rows and projected, over Gemma 3's text model. The processor writes each image as its
start-of-image token, that many image tokens and its end-of-image token (pan-and-scan adds a run per crop,
each as long); the image tokens of a run attend to each other both ways, as Hugging Face's token_type_ids
mask has them, which the scheduler and the attention provide (Request.image_blocks)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.images import ImageInput
from engine.model.families.vision import LanguagePart, VisionFamily

if TYPE_CHECKING:
    from engine.model.invariant_tower import LinearKernel


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

    def use_linear_kernel(self, kernel: LinearKernel) -> int:
        # The projector multiplies by its weight [vision, text] with torch.matmul, outside an nn.Linear.
        model = self.hf_model.model
        model.multi_modal_projector = _Projector(model.multi_modal_projector, kernel)
        return 1

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


class _Projector(torch.nn.Module):
    """Hugging Face's Gemma3MultiModalProjector (pooled, normed, projected) with its projection on a kernel."""

    def __init__(self, projector: torch.nn.Module, kernel: LinearKernel) -> None:
        super().__init__()
        self.avg_pool = projector.avg_pool
        self.mm_soft_emb_norm = projector.mm_soft_emb_norm
        self.patches_per_image: int = projector.patches_per_image
        weight = projector.mm_input_projection_weight.T.contiguous()
        self.project: Callable[[torch.Tensor], torch.Tensor] = kernel(weight, None)

    def forward(self, vision_outputs: torch.Tensor) -> torch.Tensor:
        batch_size, _, hidden_size = vision_outputs.shape
        side = self.patches_per_image
        grid = vision_outputs.transpose(1, 2).reshape(batch_size, hidden_size, side, side).contiguous()
        pooled = self.avg_pool(grid).flatten(2).transpose(1, 2)
        return self.project(self.mm_soft_emb_norm(pooled)).type_as(vision_outputs)
