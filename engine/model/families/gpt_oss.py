"""gpt-oss (model_type gpt_oss): Mixtral's decoder layer with attention sinks (a learned logit per head in
every softmax), sliding-window layers alternating with global ones, biases on q/k/v/o, and a mixture of
experts whose router (with a bias) takes each token's top-k logits and a softmax over those alone, and
whose experts (biased, their gate and up columns interleaved) apply a clamped SwiGLU, (up + 1) * gate *
sigmoid(alpha * gate), which their module's `_apply_gate` computes (engine/model/moe.py calls it).

Its rotary module returns cos and sin over half a head, for its own rotation of the two halves; the same
rotation as Llama's over the whole head with the table repeated, which is what Rotary applies."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.model.families.mixtral import Mixtral
from engine.model.layers import LayerOps, Rotary, self_attention
from engine.model.moe import Routing, sparse_moe


class GptOss(Mixtral):
    model_types = ("gpt_oss",)

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__(hf_model)
        self.routing = Routing.TOP_K_SOFTMAX

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> Rotary:
        cos, sin = self.rotary_emb(hidden[None], positions[None])
        return Rotary(torch.cat((cos, cos), dim=-1)[0].unsqueeze(1), torch.cat((sin, sin), dim=-1)[0].unsqueeze(1))

    def layer(
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        attn = layer.self_attn
        x = ops.normalize(layer.input_layernorm, hidden)
        attended = self_attention(ops, index, attn, x, rotary, self.attention, self.windows[index], sinks=attn.sinks)
        hidden, x = ops.add_normalize(layer.post_attention_layernorm, hidden, attended)
        return hidden + sparse_moe(ops, layer.mlp, x, self.top_k, self.routing)
