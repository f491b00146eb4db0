"""Qwen2-VL's and Qwen2.5-VL's decoder: Qwen2's layer (Llama's, with biases on q/k/v) rotated by M-RoPE, each
token by three positions (time, row, column: engine/rope_positions.py), the head's frequencies in a section per
axis (rope_parameters' mrope_section), as Hugging Face's rotary module composes them. Served only under its
vision family (engine/model/families/qwen_vl.py): transformers has no text-only model of it."""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.model.families.llama import Llama
from engine.model.layers import Rotary


class QwenVLText(Llama):
    model_types: ClassVar[tuple[str, ...]] = ()

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> Rotary:
        """`positions`: [3, T], or [T] where every token's three are its index (text alone)."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        cos, sin = self.rotary_emb(hidden[None], positions[:, None])
        return Rotary(cos[0].unsqueeze(1), sin[0].unsqueeze(1))
