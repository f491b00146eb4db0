"""Tiny random models (two layers, 64 wide) with a real tokenizer, loaded as a server loads a model, and
engines over them: what the unit tests and the host-cost benches run where weights do not matter."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from engine.config import EngineConfig
from engine.detokenizer import TokenBytes
from engine.engine import Engine
from engine.model.causal_lm import PagedCausalLM
from engine.model.invariant_kernels import use_invariant_kernels
from engine.model.loader import LoadedModel

TINY_VOCAB = 512

# What a family's tiny random configuration sets beyond the common shape (engine/model/families/).
FAMILY_CONFIGS: dict[str, dict] = {
    # Sliding and global layers alternating, a window shorter than the longest prompt, both caps biting,
    # a query_pre_attn_scalar that is not head_dim.
    "gemma2": {
        "num_hidden_layers": 4,
        "sliding_window": 12,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
        "query_pre_attn_scalar": 24,
    },
    # Local and global layers with their own rotary bases, QK-norm.
    "gemma3_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 12,
        "final_logit_softcapping": 5.0,
        "query_pre_attn_scalar": 24,
    },
    # Sliding and global layers alternating (its default layer_types) under a window shorter than the longest
    # prompt; 8 experts, top-2; a clamp of the experts' activation that bites; random biases (_RANDOM_BIASES).
    "gpt_oss": {
        "num_hidden_layers": 4,
        "sliding_window": 12,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "swiglu_limit": 1.0,
        # YaRN as gpt-oss ships it, scaled to the tiny context.
        "rope_parameters": dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=32,
        ),
    },
    # Multipliers far from 1 (attention's from 1/sqrt(head_dim)), so that leaving any one out changes the output.
    "granite": dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.5),
    "llama": {},
    # A window shorter than the longest prompt: served through it, to the whole context.
    "mistral": {"sliding_window": 12},
    # 8 experts, top-2, routing weights renormalized over the two.
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
    "olmo2": {},
    # As Phi-4-mini: LongRoPE over half of each head. Every prompt is longer than the pretraining length, so
    # Hugging Face too rotates it by the long factors throughout.
    "phi3": dict(
        # Its default token ids are outside the tiny vocabulary.
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=2,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            partial_rotary_factor=0.5,
            short_factor=[1.0, 1.2, 1.5, 2.0],
            long_factor=[1.0, 3.0, 9.0, 27.0],
        ),
    ),
    "qwen2": {},
    "qwen3": {},
    # 8 experts, top-2 without renormalizing; layer 1 keeps a dense MLP (mlp_only_layers) so both paths run.
    "qwen3_moe": {
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
    },
    # Layer 0 rotates q and k, layer 1 does not. Its default token ids are outside the tiny vocabulary.
    "smollm3": dict(no_rope_layers=[1, 0], bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


# Families whose initializer leaves biases at zero, which would leave their addition untested: drawn at random.
_RANDOM_BIASES = frozenset({"gpt_oss"})


def tiny_hf_model(
    model_type: str = "llama", seed: int = 0, repetitive: bool = False, vocab_size: int = TINY_VOCAB, **overrides
):
    """A 2-layer random model of the family `model_type` whose logits are peaked enough for greedy decoding
    to be stable; `overrides` set config fields over the family's tiny configuration.

    `repetitive`: tied embeddings and damped layers, so it mostly repeats its last token and
    now and then switches; speculative proposals are then often accepted and often rejected.
    """
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=repetitive,
    )
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**common, **FAMILY_CONFIGS[model_type], **overrides})
    # Eager attention, the reference every family implements in full: transformers 5.17 picks SDPA for Gemma 2,
    # which drops its soft-capping without a word (other logits than eager's, measured).
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if model_type in _RANDOM_BIASES:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, config.initializer_range)
    if repetitive:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.3)
                layer.mlp.down_proj.weight.mul_(0.3)
    return model


def tiny_loaded(
    tokenizer,
    model_type: str = "llama",
    repetitive: bool = False,
    vocab_size: int = TINY_VOCAB,
    kernels_cache: Path | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantize: str | None = None,
    hf_model: PreTrainedModel | None = None,
) -> LoadedModel:
    """`kernels_cache`: run on the batch-invariant kernels (as a server does by default), built there;
    `quantize` ("q8_0", "q4_1") quantizes the weights for them. `hf_model`: the model to load (a test's own
    weights) instead of tiny_hf_model's of `model_type`."""
    hf = tiny_hf_model(model_type, repetitive=repetitive, vocab_size=vocab_size) if hf_model is None else hf_model
    hf = hf.to(device=device, dtype=dtype)
    model = PagedCausalLM(hf)
    if kernels_cache is not None:
        use_invariant_kernels(model, hf, kernels_cache, quantize=quantize)
        assert model.batch_invariant, "the batch-invariant kernels did not build on this machine"
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        token_bytes=TokenBytes.from_tokenizer(tokenizer),
        name=f"tiny-{model_type}",
        path=Path("."),
        eos_token_ids=frozenset(),
        max_position_embeddings=1024,
        vocab_size=model.vocab_size,
    )


def tiny_engine(loaded: LoadedModel, draft_model: PagedCausalLM | None = None, **overrides) -> Engine:
    config = dict(
        max_num_seqs=16,
        max_num_batched_tokens=32,
        max_model_len=1024,
        block_size=4,
        num_kv_blocks=512,
        max_unread_tokens=1 << 20,
    )
    config.update(overrides)
    return Engine(loaded, EngineConfig(**config), draft_model)
