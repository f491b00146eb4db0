"""Int4 weight-only copies of linear layers, for steps small enough to be bound by weight bytes.

At a handful of tokens per step a CPU decode streams every weight from memory once and
does little arithmetic on it, so its time is the weights' size: 4-bit weights (with a
scale and an offset per group of 32) read a quarter of bf16's bytes. At larger batches
the int4 kernel's unpacking costs more than the bytes it saves and bf16 wins, which is
why the model keeps both and picks per step (see PagedCausalLM.forward).

The group layout is the GGUF Q4_1 block's (32 weights, w = d * q + m), so the default
model's own 4-bit weights, dequantized on conversion, come back exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32


def int4_supported(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass(frozen=True)
class Int4Weight:
    """A [N, K] weight as packed 4-bit values plus per-group scales and offsets."""

    packed: torch.Tensor
    # [K / group, N, 2]: the kernel dequantizes w = (q - 8) * scale + zero.
    scales_and_zeros: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
        """Asymmetric min/max quantization per group of 32 along K; `dtype` is the activations'."""
        out_features, in_features = weight.shape
        groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = ((groups - low) / scale).round().clamp(0, 15).reshape(out_features, in_features)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        zero = low + 8 * scale
        scales_and_zeros = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], dim=-1)
        return cls(packed=packed, scales_and_zeros=scales_and_zeros.contiguous().to(dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_and_zeros)


def int4_copies(model: torch.nn.Module, dtype: torch.dtype) -> dict[torch.nn.Linear, Int4Weight]:
    """Int4 copies of every linear layer of `model` the kernel can take (no bias, K a multiple
    of the group), quantized from their current weights: load them in float32 first."""
    return {
        module: Int4Weight.quantize(module.weight, dtype)
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and module.bias is None and module.in_features % GROUP_SIZE == 0
    }
