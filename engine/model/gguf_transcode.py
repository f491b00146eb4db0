"""GGUF block types the CPU kernels have no form of their own for, rewritten as blocks of a form they have
that holds the same weights: GGUF's dequantizer gives both the same float32 values (bit for bit, but for the
sign of some of Q4_0's zeros), so the kernels serve such a file's layers as they serve their own forms, with
the same outputs.

- Q4_0 (w = d * (q - 8), 4-bit q) as Q4_1 (w = d * q + m) with m = -8 * d: d * q and -8 * d are exact in
  fp16 and float32, so their sum is the exact d * (q - 8), with one difference: where that is zero (q = 8, or
  d itself zero), Q4_0's zero carries the product's sign and Q4_1's is +0. No output can tell them apart
  (invariant_kernels.same_weights says why). 5 bits a weight where the file has 4.5; Q5_0 (w = d * q, 5-bit q
  less 16) would keep even the zeros' signs, but its widening made steps of 8 and 32 rows slower than float32's.
- IQ4_NL (w = d * table[q], a 4-bit index into 16 int8 values) as Q8_0 (w = d * q, int8 q): the table's
  value as q. 8.5 bits where the file has 4.5.
- Q3_K (w = (d * sc) * q, 6-bit sc less 32 per 16 weights, 3-bit q less 4) as Q6_K (w = (d * sc) * q, int8
  sc per 16 weights, 6-bit q less 32): the same d, sc and q in the wider fields. 6.6 bits where the file has
  3.4.

Each is still 4 to 9 times fewer bytes a step than float32; the loader checks every packed weight against its
float32 conversion as it does for every form, and keeps float32 where they differ (a Q4_0 d so large that -8 *
d overflows fp16, say).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.kernels.cpu.invariant import WeightForm

# IQ4_NL's 16 values (GGUF's kvalues_iq4nl).
_IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-weight block's 16 bytes of nibbles as its 32 4-bit values in weight order: weight j in byte j's
    low nibble, weight j + 16 in its high one (Q4_0's, Q4_1's and IQ4_NL's layout)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def q4_0_as_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks [..., 18 bytes: d, 16 bytes of nibbles] as Q4_1's [..., 20: d, m = -8 * d, the same
    nibbles]."""
    # A d of 8192 or more overflows here; the loader's check then keeps the tensor in float32.
    with np.errstate(over="ignore"):
        m = (blocks[..., :2].view(np.float16) * np.float16(-8)).view(np.uint8)
    return np.concatenate([blocks[..., :2], m, blocks[..., 2:]], axis=-1)


def iq4_nl_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks [..., 18 bytes: d, 16 bytes of nibbles] as Q8_0's [..., 34: d, 32 int8]."""
    values = _IQ4_NL_VALUES[_nibbles(blocks[..., 2:])]
    return np.concatenate([blocks[..., :2], values.view(np.uint8)], axis=-1)


def q3_k_as_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K super-blocks [..., 110 bytes] as Q6_K's [..., 210], the same 256 weights.

    Q3_K: hmask (32 bytes: weight 32t + j's high bit at bit t of byte j, set where q is not lowered by 4),
    qs (64: weight 128h + 32t + j's low 2 bits at bits 2t of byte 32h + j), 12 bytes of 16 6-bit scales (the
    low 4 bits of scale s in byte s % 8, nibble s // 8; the high 2 bits in byte 8 + s % 4, at bits 2 (s // 4)),
    d (fp16). Q6_K: ql (128: weight 128h + 64s + j's low 4 bits of q + 32 in byte 64h + j, nibble s), qh (64:
    weight 128h + 32t + j's high 2 bits at bits 2t of byte 32h + j), 16 int8 scales, d."""
    shape = blocks.shape[:-1]
    hmask, qs, packed_scales, d = blocks[..., :32], blocks[..., 32:96], blocks[..., 96:108], blocks[..., 108:110]
    t = np.arange(8, dtype=np.uint8)
    high = (hmask[..., None, :] >> t[:, None]) & 1  # [..., t, j]: weight 32t + j
    low = (qs.reshape(*shape, 2, 1, 32) >> (2 * t[:4, None])) & 3  # [..., h, t, j]: weight 128h + 32t + j
    q = low.reshape(*shape, 256).astype(np.int8) - 4 * (1 - high.reshape(*shape, 256)).astype(np.int8)
    s = np.arange(16)
    low_scales = packed_scales[..., s % 8] >> (4 * (s // 8)) & 15
    high_scales = packed_scales[..., 8 + s % 4] >> (2 * (s // 4)) & 3
    scales = (low_scales | high_scales << 4).astype(np.int8) - 32
    u = (q + 32).astype(np.uint8).reshape(*shape, 2, 2, 64)  # [..., h, s, j]: weight 128h + 64s + j
    ql = (u[..., 0, :] & 15) | ((u[..., 1, :] & 15) << 4)
    u = u.reshape(*shape, 2, 4, 32)  # [..., h, t, j]: weight 128h + 32t + j
    qh = np.bitwise_or.reduce(((u >> 4) & 3) << (2 * t[:4, None]), axis=-2)
    return np.concatenate([ql.reshape(*shape, 128), qh.reshape(*shape, 64), scales.view(np.uint8), d], axis=-1)


# A GGUF type → the form its blocks are rewritten as, and how: rows [N, K / block weights * block bytes].
TRANSCODED: dict[GGMLQuantizationType, tuple[WeightForm, Callable[[np.ndarray], np.ndarray]]] = {
    GGMLQuantizationType.Q4_0: (WeightForm.Q4_1, q4_0_as_q4_1),
    GGMLQuantizationType.IQ4_NL: (WeightForm.Q8_0, iq4_nl_as_q8_0),
    GGMLQuantizationType.Q3_K: (WeightForm.Q6_K, q3_k_as_q6_k),
}


def transcode(kind: GGMLQuantizationType, rows: np.ndarray) -> tuple[WeightForm, np.ndarray]:
    """Rows of `kind`'s blocks [N, bytes] as the form TRANSCODED names, [N, the form's bytes]."""
    form, rewrite = TRANSCODED[kind]
    blocks = rows.reshape(rows.shape[0], -1, GGML_QUANT_SIZES[kind][1])
    return form, rewrite(blocks).reshape(rows.shape[0], -1)
