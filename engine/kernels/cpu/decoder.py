"""Every decoder layer of a step in one native call (decoder.cpp), for families whose layer is Llama's.

A decode step of a small model on a CPU was mostly Python: some forty torch ops and ctypes calls a layer,
thirty layers, around a few milliseconds of arithmetic. The call does the same arithmetic (the invariant
linear and attention kernels, torch's own RMSNorm and SiLU bit for bit), so its outputs are the bits of
the layers run op by op; it only runs where that holds: Llama's layer (engine/model/families/llama.py),
optionally with biased projections (Qwen2), per-head q/k norms (Qwen3) and sliding windows (Mistral), on
float32 rotary tables as wide as the head.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch

from engine.kernels.cpu.invariant import CACHE_DTYPES, KernelAttentionMetadata, PackedLinear
from engine.kv_cache import KVCache

# Norm classes computing Llama's RMSNorm, w * (x * rsqrt(mean(x^2) + eps)), in float32 (Gemma's 1 + w is not).
_LLAMA_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# Activation classes computing torch's F.silu (transformers' ACT2FN["silu"] is the second).
_SILUS = ("SiLU", "SiLUActivation")
# How long a thread spins at one of the step's barriers before it sleeps (barrier.h): longer than the threads'
# usual lead over each other within a step, far shorter than a scheduler's time slice; and only in steps of at
# most BARRIER_SPIN_MAX_TOKENS tokens. Past that a step's work between barriers dwarfs a wake-up, and the
# cores a spin would hold are the event loop's, which has as many streams to write (docs/performance.md,
# "Barriers that spin": no gain at 32 streams, a loss at 64).
BARRIER_SPIN_NS = 50_000
BARRIER_SPIN_MAX_TOKENS = 16


class _Linear(ctypes.Structure):
    _fields_ = [
        ("form", ctypes.c_int64),
        ("panels", ctypes.c_void_p),
        ("out_features", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("input_eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
        ("q_eps", ctypes.c_float),
        ("k_eps", ctypes.c_float),
        *((name, _Linear) for name in ("q", "k", "v", "o", "gate", "up", "down")),
        ("window", ctypes.c_int64),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("scalar", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("cache_dtype", ctypes.c_int64),
        ("key_cache", ctypes.c_void_p),
        ("value_cache", ctypes.c_void_p),
        ("layer_stride", ctypes.c_int64),
        ("slot_mapping", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("table_width", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("table_rows", ctypes.c_void_p),
        ("context_lens", ctypes.c_void_p),
        ("barrier_spin_ns", ctypes.c_int64),
    ]


def _linear(packed: PackedLinear) -> _Linear:
    bias = None if packed.bias is None else packed.bias.data_ptr()
    return _Linear(packed.form, packed.panels.data_ptr(), packed.out_features, packed.in_features, bias)


def _norm(module: torch.nn.Module | None) -> tuple[int | None, float, torch.Tensor | None]:
    """A norm's weight pointer, epsilon and float32 weight (kept alive by the caller); nothing for None."""
    if module is None:
        return None, 0.0, None
    weight = module.weight.detach().float().contiguous()
    return weight.data_ptr(), float(module.variance_epsilon), weight


def _is_llama_norm(module: torch.nn.Module | None) -> bool:
    return module is None or (type(module).__name__ in _LLAMA_NORMS and module.weight.dtype == torch.float32)


@dataclass(frozen=True)
class InvariantDecoder:
    """A model's decoder layers as sl_decoder_layers reads them; `scalar` runs the linear layers' portable
    variant (the same bits); `barrier_spin_ns` bounds a thread's spin at a barrier (0: it sleeps at once)."""

    library: ctypes.CDLL
    layers: ctypes.Array
    # The tensors the layers' pointers point into (the norms' float32 weights; the packed weights and biases).
    keep: tuple[object, ...]
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    scale: float
    scalar: bool = False
    barrier_spin_ns: int = BARRIER_SPIN_NS

    @classmethod
    def of(
        cls,
        library: ctypes.CDLL,
        layers: list[torch.nn.Module],
        packed: dict[torch.nn.Module, PackedLinear],
        windows: tuple[int, ...],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
    ) -> InvariantDecoder | None:
        """`layers` (Llama's modules, their linear layers in `packed`) in one call, or None where one of them
        is not Llama's layer on the invariant kernels as decoder.cpp computes it."""
        structs, keep = [], []
        for layer, window in zip(layers, windows):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj)
            linears = [packed.get(module) for module in (*projections, mlp.down_proj)]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            if (
                any(linear is None for linear in linears)
                or not all(_is_llama_norm(norm) for norm in (*norms, q_norm, k_norm))
                or (q_norm is None) != (k_norm is None)
                or type(mlp.act_fn).__name__ not in _SILUS
                or linears[3].bias is not None
                or linears[6].bias is not None
            ):
                return None
            (input_norm, input_eps, input_weight), (post_norm, post_eps, post_weight) = map(_norm, norms)
            (q_pointer, q_eps, q_weight), (k_pointer, k_eps, k_weight) = _norm(q_norm), _norm(k_norm)
            keep += [input_weight, post_weight, q_weight, k_weight, *linears]
            structs.append(
                _Layer(
                    input_norm,
                    post_norm,
                    q_pointer,
                    k_pointer,
                    input_eps,
                    post_eps,
                    q_eps,
                    k_eps,
                    *map(_linear, linears),
                    window,
                )
            )
        q, gate = structs[0].q, structs[0].gate
        return cls(
            library,
            (_Layer * len(structs))(*structs),
            tuple(keep),
            hidden=q.in_features,
            heads=num_heads,
            kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate=gate.out_features,
            scale=scale,
        )

    def first_layers(self, num_layers: int) -> InvariantDecoder:
        """The first layers only (a self-draft's)."""
        return replace(self, layers=(_Layer * num_layers)(*self.layers[:num_layers]))

    def runs(self, cos: torch.Tensor, kv_cache: KVCache) -> bool:
        """Whether a step with these rotary tables [T, 1, rotary_dim] and cache runs here: float32 tables as wide
        as the head (partial rotary is not decoder.cpp's), a cache of one of CACHE_DTYPES."""
        return (
            cos.dtype == torch.float32
            and cos.shape[-1] == self.head_dim
            and cos.is_contiguous()
            and kv_cache.key.dtype in CACHE_DTYPES
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        slot_mapping: torch.Tensor,
        attention: KernelAttentionMetadata,
    ) -> torch.Tensor:
        """hidden [T, hidden] (float32, the step's own: updated in place) through every layer, this step's
        keys and values written into kv_cache's slots `slot_mapping`."""
        key, value = kv_cache.key, kv_cache.value
        step = _Step(
            hidden.shape[0],
            self.hidden,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.intermediate,
            self.scale,
            self.scalar,
            cos.data_ptr(),
            sin.data_ptr(),
            CACHE_DTYPES[key.dtype],
            key.data_ptr(),
            value.data_ptr(),
            key.stride(0),
            slot_mapping.data_ptr(),
            attention.block_tables.data_ptr(),
            attention.block_tables.shape[1],
            attention.block_size,
            attention.table_rows.data_ptr(),
            attention.context_lens.data_ptr(),
            self.barrier_spin_ns if hidden.shape[0] <= BARRIER_SPIN_MAX_TOKENS else 0,
        )
        layers = self.layers
        self.library.sl_decoder_layers(ctypes.addressof(layers), len(layers), ctypes.addressof(step), hidden.data_ptr())
        return hidden
