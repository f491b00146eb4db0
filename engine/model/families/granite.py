"""Granite (model_type granite; Granite 3.x dense): Llama's decoder layer with four multipliers. The
embeddings are scaled by embedding_multiplier, each layer's attention and MLP outputs by
residual_multiplier before the residual add, attention scores by attention_multiplier (in place of
1/sqrt(head_dim); the attention module's `scaling`, which the base class reads), and the logits divided by
logits_scaling."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.model.families.base import DecoderFamily
from engine.model.layers import LayerOps, Rotary, gated_mlp, self_attention


class Granite(DecoderFamily):
    model_types = ("granite",)
    transforms_logits = True

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__(hf_model)
        config = hf_model.config
        self._embedding_multiplier = config.embedding_multiplier
        self._residual_multiplier = config.residual_multiplier
        self._logits_scaling = config.logits_scaling

    def embed(self, embed_tokens: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_tokens(input_ids) * self._embedding_multiplier

    def layer(
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        scale = self._residual_multiplier
        x = ops.normalize(layer.input_layernorm, hidden)
        attended = self_attention(ops, index, layer.self_attn, x, rotary, self.attention, self.windows[index])
        hidden, x = ops.add_normalize(layer.post_attention_layernorm, hidden, attended * scale)
        return hidden + gated_mlp(ops, layer.mlp, x) * scale

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self._logits_scaling
