"""Qwen2.5-VL (and Qwen2-VL): a ViT over an image at its own resolution (dynamic resolution: the image processor
resizes it to a multiple of 28 pixels within min_pixels..max_pixels, its grid of 14-pixel patches merged 2 x 2
into image tokens), over Qwen2's decoder rotated by M-RoPE (engine/model/families/qwen_vl_text.py): an image's
tokens by their place in its grid, the text after it from past its largest side (engine/rope_positions.py).

transformers' processor for these models takes a video processor, which needs torchvision (whose wheels do not
import beside torch 2.13 here), so QwenVLProcessor stands in for it: transformers' own image processor in its
PIL form (Qwen2VLImageProcessorPil: PIL and numpy), read from the folder's preprocessor_config.json, and the
placeholder's expansion the processor does (each <|image_pad|> into an image's tokens)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine.images import ImageInput
from engine.model.families.qwen_vl_text import QwenVLText
from engine.model.families.vision import VisionFamily
from engine.rope_positions import RopePositions


@dataclass
class QwenVLProcessor:
    """Images and a rendered prompt → the model's inputs, as transformers' Qwen2_5_VLProcessor makes them for
    images (no videos)."""

    image_processor: Qwen2VLImageProcessorPil
    tokenizer: PreTrainedTokenizerBase
    chat_template: str | None = None
    # The placeholder the chat template writes once per image, between <|vision_start|> and <|vision_end|>.
    image_token: str = "<|image_pad|>"

    @classmethod
    def from_pretrained(cls, path: Path, tokenizer: PreTrainedTokenizerBase) -> QwenVLProcessor:
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        elif (path / "chat_template.json").is_file():
            template = json.loads((path / "chat_template.json").read_text())["chat_template"]
        return cls(Qwen2VLImageProcessorPil.from_pretrained(path), tokenizer, template or tokenizer.chat_template)

    def save_pretrained(self, path: Path) -> None:
        self.image_processor.save_pretrained(path)
        if self.chat_template is not None:
            (Path(path) / "chat_template.jinja").write_text(self.chat_template)
        self.tokenizer.save_pretrained(path)

    def apply_chat_template(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation rendered by the model's chat template (an image part as its placeholder)."""
        rendered = self.tokenizer.apply_chat_template(
            conversation, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert isinstance(rendered, str)
        return rendered

    def __call__(self, text: list[str], images: Sequence[Any], return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        """input_ids, attention_mask and mm_token_type_ids of the one prompt `text[0]` with each placeholder
        expanded into its image's tokens, and the images' pixel_values and image_grid_thw."""
        (prompt,) = text
        pieces = prompt.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders for {len(images)} images")
        pixels = self.image_processor(images=list(images), return_tensors=return_tensors) if images else {}
        merge = self.image_processor.merge_size
        counts = [int(grid.prod()) // merge**2 for grid in pixels.get("image_grid_thw", [])]
        expanded = pieces[0] + "".join(self.image_token * count + piece for count, piece in zip(counts, pieces[1:]))
        ids = torch.tensor([self.tokenizer(expanded)["input_ids"]])
        image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == image_token_id).int(),
            **pixels,
        }


class QwenVL(VisionFamily):
    model_types = ("qwen2_5_vl", "qwen2_vl")
    decoder = QwenVLText
    rope_by_grid = True

    @classmethod
    def load_processor(cls, path: Path, tokenizer: PreTrainedTokenizerBase) -> QwenVLProcessor:
        return QwenVLProcessor.from_pretrained(path, tokenizer)

    def prompt(self, processor: Any, text: str, images: Sequence[Any]) -> tuple[list[int], tuple[ImageInput, ...]]:
        outputs = processor([text], images)
        merge = processor.image_processor.merge_size
        return self.images_of(outputs, [int(grid.prod()) // merge**2 for grid in outputs.get("image_grid_thw", [])])

    def split(self, outputs: Mapping[str, torch.Tensor], num_rows: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Each image's patches (rows of pixel_values: its grid's time x height x width) and its grid."""
        grids = outputs["image_grid_thw"]
        split, start = [], 0
        for i, grid in enumerate(grids):
            count = int(grid.prod())
            pixels = outputs["pixel_values"][start : start + count]
            split.append({"pixel_values": pixels, "image_grid_thw": grids[i : i + 1]})
            start += count
        return split

    def rope_positions(self, num_tokens: int, images: Sequence[ImageInput]) -> RopePositions:
        merge = self.hf_model.config.vision_config.spatial_merge_size
        grids = []
        for image in sorted(images, key=lambda image: image.start):
            time, height, width = image.inputs["image_grid_thw"][0].tolist()
            grids.append((image.start, time, height // merge, width // merge))
        return RopePositions.of(num_tokens, grids)
