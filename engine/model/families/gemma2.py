"""Gemma 2: embeddings scaled by sqrt(hidden_size) (HF's embedding module does it), Gemma's RMSNorm (times
1 + weight, which the HF module computes: the GPU's RMSNorm kernel does not replace it), a norm after
attention and after the MLP as well as before each, attention scores soft-capped, sliding-window layers
alternating with global ones, query_pre_attn_scalar's scale (the module's `scaling`), a GELU-tanh gated
MLP, and the final logits soft-capped."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.model.families.base import DecoderFamily
from engine.model.layers import LayerOps, Rotary, gated_mlp, self_attention


class Gemma2(DecoderFamily):
    model_types = ("gemma2",)

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__(hf_model)
        config = hf_model.config
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{config.model_type}: use_bidirectional_attention (an encoder's) is not served")
        self.attention_softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.final_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        self.transforms_logits = bool(self.final_softcap)

    def layer(
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        x = ops.normalize(layer.input_layernorm, hidden)
        attended = self_attention(
            ops, index, layer.self_attn, x, rotary, self.attention, self.windows[index], self.attention_softcap
        )
        hidden, x = ops.add_normalize(
            layer.pre_feedforward_layernorm, hidden, ops.normalize(layer.post_attention_layernorm, attended)
        )
        return hidden + ops.normalize(layer.post_feedforward_layernorm, gated_mlp(ops, layer.mlp, x))

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.final_softcap:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
