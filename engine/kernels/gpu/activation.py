"""The gated MLP's activation, silu(gate) * up, in one Triton launch on a GPU.

Unfused it is two of torch's launches and a [T, intermediate] tensor written and read back between
them. Here gate and up are read once (views of the fused gate/up projection, any row stride) and the
product written once, rounded where torch rounds: silu's float result to the activations' dtype, then
the product. silu is x / (1 + exp(-x)) in float32 with libdevice's exp and a correctly rounded
division, the functions torch's CUDA kernel compiles to, so the bits are torch's (Triton's own exp is
a faster approximation; Triton's interpreter, which has no libdevice, takes it).

Triton compiles for CUDA; with TRITON_INTERPRET=1 set before this module is imported it runs on
CPU tensors too, which is how the tests check it on machines without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024
LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [T, I] whose rows are contiguous (any row stride) → [T, I]."""
    num_rows, width = gate.shape
    out = torch.empty((num_rows, width), dtype=gate.dtype, device=gate.device)
    if num_rows:
        _silu_and_mul[(num_rows, triton.cdiv(width, BLOCK))](
            gate,
            up,
            out,
            width,
            gate.stride(0),
            up.stride(0),
            BLOCK=BLOCK,
            LIBDEVICE=LIBDEVICE,
            enable_fp_fusion=False,
        )
    return out


@triton.jit
def _silu_and_mul(
    gate_ptr, up_ptr, out_ptr, width, gate_row_stride, up_row_stride, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < width
    gate = tl.load(gate_ptr + row * gate_row_stride + columns, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * up_row_stride + columns, mask=mask, other=0.0)
    wide = gate.to(tl.float32)
    if LIBDEVICE:
        exp = libdevice.exp(-wide)
    else:
        exp = tl.exp(-wide)
    activated = tl.div_rn(wide, 1.0 + exp).to(gate.dtype)
    product = (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * width + columns, product, mask=mask)
