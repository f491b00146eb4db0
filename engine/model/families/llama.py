"""Llama and the families that share its decoder layer exactly: Mistral (a sliding window on every
layer), Qwen2 (biases on q/k/v, which the projections carry), Qwen3 (per-head RMSNorm of q and k, which
self_attention finds on the module); Qwen2 and Qwen3 may slide on some layers."""

from __future__ import annotations

import torch

from engine.model.families.base import DecoderFamily
from engine.model.layers import LayerOps, Rotary, gated_mlp, self_attention


class Llama(DecoderFamily):
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    llama_layer = True

    def layer(
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        x = ops.normalize(layer.input_layernorm, hidden)
        attended = self_attention(ops, index, layer.self_attn, x, rotary, self.attention, self.windows[index])
        hidden, x = ops.add_normalize(layer.post_attention_layernorm, hidden, attended)
        return hidden + gated_mlp(ops, layer.mlp, x)
