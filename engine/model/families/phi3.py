"""Phi-3 and Phi-4 (model_type phi3): Llama's decoder layer with q, k and v in one projection and the MLP's
gate and up in one, whose outputs are split. LongRoPE scaling (the 128k-context members) and partial rotary
(Phi-4-mini) come with the rotary tables (engine/model/layers.py)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.model.families.base import DecoderFamily
from engine.model.layers import LayerOps, Rotary, attention_heads


class Phi3(DecoderFamily):
    model_types = ("phi3",)

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__(hf_model)
        shape = self.attention
        kv_width = shape.num_kv_heads * shape.head_dim
        # qkv_proj's output is q, then k, then v.
        self._qkv_widths = (shape.num_heads * shape.head_dim, kv_width, kv_width)

    def layer(
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = ops.project(attn.qkv_proj, ops.normalize(layer.input_layernorm, hidden)).split(self._qkv_widths, -1)
        attended = attention_heads(ops, index, attn, q, k, v, rotary, self.attention, self.windows[index])
        hidden, x = ops.add_normalize(layer.post_attention_layernorm, hidden, attended)
        # gate_up_proj's output is the gate, then up.
        gate, up = ops.project(mlp.gate_up_proj, x).chunk(2, -1)
        return hidden + ops.project(mlp.down_proj, ops.gate(mlp.activation_fn, gate, up))
