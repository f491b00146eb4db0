"""Builders shared by unit tests: tiny random models, engines and requests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.channel import StreamChannel
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, StopMatcher, TokenBytes
from engine.engine import Engine
from engine.model.causal_lm import PagedCausalLM
from engine.model.loader import LoadedModel, use_invariant_kernels
from engine.request import Request
from engine.types import Chunk, SamplingParams
from tests.conftest import CACHE_DIR

TINY_VOCAB = 512

# One of each way of sampling: greedy, temperature alone, and each truncation (keyword arguments of SamplingParams).
SAMPLING_KINDS = [
    dict(temperature=0.0),
    dict(temperature=0.8),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.2, top_k=20),
    dict(temperature=0.7, min_p=0.1, top_p=0.95),
]


# What a family's tiny random configuration sets beyond the common shape (engine/model/families/).
FAMILY_CONFIGS: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
}


def tiny_hf_model(model_type: str = "llama", seed: int = 0, repetitive: bool = False, vocab_size: int = TINY_VOCAB):
    """A 2-layer random model of the family `model_type` whose logits are peaked enough for greedy decoding
    to be stable.

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
    config = AutoConfig.for_model(model_type, **{**common, **FAMILY_CONFIGS[model_type]})
    model = AutoModelForCausalLM.from_config(config).eval()
    if repetitive:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.3)
                layer.mlp.down_proj.weight.mul_(0.3)
    return model


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face's own greedy decoding of `prompt`: the reference the paged forward must reproduce."""
    out = hf_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def tiny_loaded(
    tokenizer,
    model_type: str = "llama",
    repetitive: bool = False,
    vocab_size: int = TINY_VOCAB,
    kernels: bool = False,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """`kernels`: run on the batch-invariant kernels, as a server does by default."""
    hf = tiny_hf_model(model_type, repetitive=repetitive, vocab_size=vocab_size).to(device=device, dtype=dtype)
    model = PagedCausalLM(hf)
    if kernels:
        use_invariant_kernels(model, hf, CACHE_DIR)
        assert model.batch_invariant, "the batch-invariant kernels did not build on this machine"
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        token_bytes=TokenBytes.from_tokenizer(tokenizer),
        name=f"tiny-{model_type}",
        path=Path("."),
        eos_token_ids=frozenset(),
        max_position_embeddings=1024,
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


def make_request(
    prompt_len: int, max_tokens: int = 8, params: SamplingParams | None = None, first_token: int = 1
) -> Request:
    """A request for scheduler tests: no model, no loop is ever touched. Its prompt counts up
    from `first_token`, so requests of one `first_token` share their prefixes."""
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(
        request_id="r",
        prompt_token_ids=list(range(first_token, first_token + prompt_len)),
        params=params,
        channel=StreamChannel(asyncio.new_event_loop(), num_choices=params.n),
        detokenizer=IncrementalDetokenizer(TokenBytes([b""] * TINY_VOCAB)),
        stop_matcher=StopMatcher(params.stop),
    )


async def collect(engine: Engine, prompt: list[int], params: SamplingParams) -> list[Chunk]:
    channel = StreamChannel(asyncio.get_running_loop(), num_choices=params.n)
    engine.submit("t", prompt, params, channel)
    return [chunk async for chunk in channel]


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def tokens_of(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]
