"""DecoderFamily: what a family of decoder-only models does in a forward, over the shared blocks of
engine/model/layers.py. A family's file says only what differs from the defaults here."""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PreTrainedModel

from engine.model.layers import AttentionShape, LayerOps, LongRope, Rotary


class DecoderFamily:
    """Built from the Hugging Face model it runs (whose modules hold the weights); the forward loop
    (engine/model/causal_lm.py) calls embed, rotary, layer for each layer, then the final norm and logits.

    The defaults are Llama's: token embeddings as they are, one rotary table for every layer, a final
    RMSNorm, logits as the head computes them."""

    # The config.model_type values this family serves.
    model_types: ClassVar[tuple[str, ...]] = ()
    # The fields a checkpoint's config.json must give: where one is absent transformers puts in its class's
    # default (a 4096-wide Llama of 32 layers), and the weights then do not fit.
    required_config: ClassVar[tuple[str, ...]] = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "vocab_size",
    )

    def __init__(self, hf_model: PreTrainedModel) -> None:
        config = hf_model.config
        self.config = config
        inner = hf_model.model
        self.rotary_emb = inner.rotary_emb
        # LongRoPE takes one set of factors here, where Hugging Face's module picks them per forward.
        self._long_rope = (
            LongRope.of(self.rotary_emb) if getattr(self.rotary_emb, "rope_type", None) == "longrope" else None
        )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        self.attention = AttentionShape(
            num_heads=num_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            scale=float(getattr(inner.layers[0].self_attn, "scaling", head_dim**-0.5)),
        )
        # Per token and layer, the widest activation of the MLP (memory sizing reads it).
        self.intermediate_size = config.intermediate_size
        # Each layer's sliding window (keys a query reads, itself included), 0 for none: the attention
        # module's own where it has one (it is None on a global layer), else the config's for every
        # layer (Mistral's).
        config_window = getattr(config, "sliding_window", None)
        self.windows = tuple(
            int(getattr(layer.self_attn, "sliding_window", config_window) or 0) for layer in inner.layers
        )

    # Whether a forward can be captured as a CUDA graph: no host work that depends on the step's values.
    graph_capturable: ClassVar[bool] = True

    # Whether `logits` changes the head's output (the head's per-block maxima then no longer hold).
    transforms_logits: ClassVar[bool] = False

    # Whether `layer` is Llama's exactly (engine/model/families/llama.py): the CPU kernels then run every
    # layer of a step in one call (engine/kernels/cpu/decoder.py).
    llama_layer: ClassVar[bool] = False

    def embed(self, embed_tokens: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_tokens(input_ids)

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> Rotary:
        if self._long_rope is not None:
            return self._long_rope.at(hidden, positions)
        return Rotary.of(self.rotary_emb, hidden, positions)

    def layer(
        self, ops: LayerOps, index: int, layer: torch.nn.Module, hidden: torch.Tensor, rotary: Rotary
    ) -> torch.Tensor:
        """Decoder layer `index` (the module `layer`) over the residual stream `hidden` [T, hidden]."""
        raise NotImplementedError

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
