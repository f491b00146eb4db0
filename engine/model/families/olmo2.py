"""OLMo 2 (model_type olmo2): its norms follow the attention and the MLP, normalizing their outputs before
the residual add, where Llama's precede them; q and k are normalized over the whole projection, before
the split into heads."""

from __future__ import annotations

import torch

from engine.model.families.base import DecoderFamily
from engine.model.layers import LayerOps, Rotary, attention_heads, gated_mlp


class Olmo2(DecoderFamily):
    model_types = ("olmo2",)

    def layer(
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        attn = layer.self_attn
        q, k, v = ops.project_all((attn.q_proj, attn.k_proj, attn.v_proj), hidden)
        q, k = ops.normalize(attn.q_norm, q), ops.normalize(attn.k_norm, k)
        attended = attention_heads(ops, index, attn, q, k, v, rotary, self.attention, self.windows[index])
        hidden = hidden + ops.normalize(layer.post_attention_layernorm, attended)
        return hidden + ops.normalize(layer.post_feedforward_layernorm, gated_mlp(ops, layer.mlp, hidden))
