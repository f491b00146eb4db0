"""Mixtral and Qwen3-MoE: Llama's decoder layer with a mixture-of-experts block (engine/model/moe.py) in
place of its MLP. Mixtral renormalizes each token's top-k routing weights; Qwen3-MoE does where its config
says (`norm_topk_prob`), adds Qwen3's per-head RMSNorm of q and k (which self_attention finds on the module)
and may keep a dense MLP in some layers (`mlp_only_layers`, `decoder_sparse_step`)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.model.families.base import DecoderFamily
from engine.model.layers import LayerOps, Rotary, gated_mlp, self_attention
from engine.model.moe import Routing, is_experts, sparse_moe


class Mixtral(DecoderFamily):
    model_types = ("mixtral", "qwen3_moe")
    # A mixture-of-experts block groups its tokens by expert on the host, which a CUDA graph cannot replay.
    graph_capturable = False

    def __init__(self, hf_model: PreTrainedModel) -> None:
        super().__init__(hf_model)
        config = self.config
        self.top_k = config.num_experts_per_tok
        renormalize = getattr(config, "norm_topk_prob", True)
        self.routing = Routing.SOFTMAX_RENORMALIZED if renormalize else Routing.SOFTMAX
        # Per layer, whether its MLP is a mixture of experts (else dense, as Qwen3-MoE's mlp_only_layers).
        self.sparse = tuple(is_experts(getattr(layer.mlp, "experts", None)) for layer in hf_model.model.layers)
        expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        # A token's rows in a sparse block: top_k slots, each its input, gate-up and output.
        sparse_width = self.top_k * (expert_width + config.hidden_size)
        dense_width = config.intermediate_size if not all(self.sparse) else 0
        self.intermediate_size = max(sparse_width, dense_width)

    def layer(
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        x = ops.normalize(layer.input_layernorm, hidden)
        attended = self_attention(ops, index, layer.self_attn, x, rotary, self.attention, self.windows[index])
        hidden, x = ops.add_normalize(layer.post_attention_layernorm, hidden, attended)
        if self.sparse[index]:
            return hidden + sparse_moe(ops, layer.mlp, x, self.top_k, self.routing)
        return hidden + gated_mlp(ops, layer.mlp, x)
