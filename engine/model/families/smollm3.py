"""SmolLM3 (model_type smollm3): Llama's decoder layer, but some layers (every fourth in SmolLM3-3B) apply no
rotary embedding (NoPE): the config's `no_rope_layers` holds 1 for each layer that does apply it."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.model.families.base import DecoderFamily
from engine.model.layers import LayerOps, Rotary, gated_mlp, self_attention


class SmolLM3(DecoderFamily):
    model_types = ("smollm3",)

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__(hf_model)
        self._uses_rope = tuple(bool(uses) for uses in hf_model.config.no_rope_layers)

    def layer(
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        x = ops.normalize(layer.input_layernorm, hidden)
        layer_rotary = rotary if self._uses_rope[index] else None
        attended = self_attention(ops, index, layer.self_attn, x, layer_rotary, self.attention, self.windows[index])
        hidden, x = ops.add_normalize(layer.post_attention_layernorm, hidden, attended)
        return hidden + gated_mlp(ops, layer.mlp, x)
