"""How many requests a step takes and how big the KV cache is, where the flags leave it open.

On a CPU the defaults are fixed (64 streams, 256 tokens a step, 2 GiB of KV cache). On a GPU they
are sized from the device, as vLLM does: up to 256 streams and 2048 tokens a step, and the KV cache
takes what `--gpu-memory-utilization` of the GPU's memory leaves once everything already on it
(this process's weights and CUDA context, and any other process's memory) and one step's
activations are set aside, and the CUDA graphs' memory pool where decode steps are captured. Both
are estimates from the model's shape, not profiled peaks: twice the tensors one step can hold at once
(a prefill chunk's attention scores over the longest context included), and twice those of the
largest captured decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.model.causal_lm import PagedCausalLM

CPU_MAX_NUM_SEQS = 64
GPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_BATCHED_TOKENS = 256
GPU_MAX_NUM_BATCHED_TOKENS = 2048
CPU_KV_CACHE_GIB = 2.0
CPU_KV_CACHE_IDLE_GIB = 0.25
# Bytes per token for the step's rows of logits: float32 logits, the sampler's weights and a copy.
_LOGITS_COPIES = 3
# Slack over the tensors a step holds at once: the allocator's rounding and fragmentation.
_ACTIVATION_SLACK = 2


@dataclass(frozen=True)
class Sizing:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_bytes: int
    # How kv_cache_bytes was arrived at, for the start-up log.
    explanation: str


def step_activation_bytes(model: PagedCausalLM, num_tokens: int, num_rows: int, max_model_len: int) -> int:
    """A generous bound on one step's transient memory: for each of `num_tokens` tokens the tensors of
    one layer (layers run one after another) and float32 attention scores of every head over
    `max_model_len` keys (a prefill chunk at the end of the longest context, on the torch path); plus
    `num_rows` rows of float32 logits with the sampler's copies."""
    per_token = _layer_bytes_per_token(model) + model.num_heads * max_model_len * 4
    logits = num_rows * model.vocab_size * 4 * _LOGITS_COPIES
    return _ACTIVATION_SLACK * (num_tokens * per_token + logits)


def graph_pool_bytes(model: PagedCausalLM, max_num_seqs: int) -> int:
    """The CUDA graphs' memory pool (engine/model/graphs.py), which stays reserved: the largest bucket's
    decode step of `max_num_seqs` rows, whose tensors the smaller buckets reuse. Per row one layer's
    tensors (the Triton decode kernel keeps no attention scores) and the row's logits, in the head's
    dtype and as float32."""
    logits = max_num_seqs * model.vocab_size * (torch.finfo(model.dtype).bits // 8 + 4)
    return _ACTIVATION_SLACK * (max_num_seqs * _layer_bytes_per_token(model) + logits)


def _layer_bytes_per_token(model: PagedCausalLM) -> int:
    """One token's hidden states, q/k/v and the MLP's three intermediates in one layer."""
    hidden = model.embed_tokens.embedding_dim
    intermediate = model.family.intermediate_size
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    return (4 * hidden + qkv + 3 * intermediate) * torch.finfo(model.dtype).bits // 8


def gpu_kv_cache_bytes(total: int, free: int, utilization: float, activations: int, graphs: int = 0) -> tuple[int, str]:
    """What the KV cache may take of a GPU with `total` bytes, `free` of them free now."""
    in_use = total - free
    budget = int(total * utilization) - in_use - activations - graphs
    gib = 2**30
    explanation = (
        f"{utilization:g} x {total / gib:.1f} GiB - {in_use / gib:.2f} GiB in use"
        f" - {activations / gib:.2f} GiB for a step's activations"
    )
    if graphs:
        explanation += f" - {graphs / gib:.2f} GiB for CUDA graphs"
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache ({explanation} = {budget / gib:.2f} GiB); "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens or --max-num-seqs, or set --kv-cache-gib"
        )
    return budget, explanation


def choose_sizes(
    model: PagedCausalLM,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    kv_cache_gib: float | None,
    gpu_memory_utilization: float,
    max_model_len: int,
    rows_per_seq: int = 1,
    memory_info: Callable[[], tuple[int, int]] | None = None,
    cuda_graphs: bool = False,
) -> Sizing:
    """The flags given, and the device's defaults for the others. `rows_per_seq`: logits rows a
    request may sample in one step (1, or 1 + proposals where it speculates). `memory_info` returns
    (free, total) bytes of the model's GPU; torch.cuda.mem_get_info by default. `cuda_graphs`: decode
    steps will be captured, so their pool is set aside too."""
    on_gpu = model.device.type == "cuda"
    seqs = max_num_seqs or (GPU_MAX_NUM_SEQS if on_gpu else CPU_MAX_NUM_SEQS)
    tokens = max_num_batched_tokens or (GPU_MAX_NUM_BATCHED_TOKENS if on_gpu else CPU_MAX_NUM_BATCHED_TOKENS)
    if max_num_batched_tokens is None and model.vision is not None and model.vision.longest_image_block:
        # An image computed in one step (Gemma 3's) fits the default budget beside a decode of every stream,
        # so it never waits for the running requests to finish.
        tokens = max(tokens, model.vision.longest_image_block + seqs)
    if kv_cache_gib is not None:
        return Sizing(seqs, tokens, int(kv_cache_gib * 2**30), f"--kv-cache-gib {kv_cache_gib:g}")
    if not on_gpu:
        return Sizing(seqs, tokens, int(CPU_KV_CACHE_GIB * 2**30), "the CPU default")
    free, total = (memory_info or (lambda: torch.cuda.mem_get_info(model.device)))()
    # A logits row belongs to a token computed in the step: never more rows than tokens.
    activations = step_activation_bytes(model, tokens, min(tokens, seqs * rows_per_seq), max_model_len)
    graphs = graph_pool_bytes(model, seqs) if cuda_graphs else 0
    budget, explanation = gpu_kv_cache_bytes(total, free, gpu_memory_utilization, activations, graphs)
    return Sizing(seqs, tokens, budget, explanation)


def num_kv_blocks(kv_cache_bytes: int, block_size: int, *models: PagedCausalLM | None) -> int:
    """How many blocks of `block_size` tokens fit in `kv_cache_bytes` for these models' K/V (the
    target and its draft, which has a block for each of the target's)."""
    return max(1, kv_cache_bytes // _block_bytes(block_size, *models))


def max_idle_cached_blocks(
    kv_cache_idle_gib: float | None, block_size: int, *models: PagedCausalLM | None
) -> int | None:
    """For the target model (first) and its draft: the most free blocks holding cached prefixes kept before one
    is reused instead of a block never used: the flag's GiB, else 0.25 GiB on a CPU (whose pool becomes resident
    as it is used) and no bound on a GPU (whose pool is allocated at start)."""
    if kv_cache_idle_gib is None and models[0].device.type == "cuda":
        return None
    gib = CPU_KV_CACHE_IDLE_GIB if kv_cache_idle_gib is None else kv_cache_idle_gib
    return int(gib * 2**30) // _block_bytes(block_size, *models)


def _block_bytes(block_size: int, *models: PagedCausalLM | None) -> int:
    per_token = sum(
        KVCache.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, m.kv_dtype) for m in models if m is not None
    )
    return per_token * block_size
