"""Gemma 3's text model: Gemma 2's layer with a per-head RMSNorm of q and k (which self_attention finds on
the module), no attention soft-capping (transformers' Gemma 3 passes none to its attention), and local
(sliding) and global layers each with a rotary table of its own base (rope_parameters per layer type,
rope_local_base_freq in older configs)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.model.families.gemma2 import Gemma2
from engine.model.layers import LayerOps, Rotary


class Gemma3(Gemma2):
    model_types = ("gemma3_text",)

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__(hf_model)
        self.attention_softcap = 0.0
        self.layer_types = tuple(hf_model.config.layer_types)

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, Rotary]:  # type: ignore[override]
        """One table per layer type."""
        return {kind: Rotary.of(self.rotary_emb, hidden, positions, kind) for kind in dict.fromkeys(self.layer_types)}

    def layer(  # type: ignore[override]
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: dict[str, Rotary]
    ) -> torch.Tensor:
        return super().layer(ops, index, layer, hidden, rotary[self.layer_types[index]])
