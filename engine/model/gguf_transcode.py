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
- TQ1_0 and TQ2_0 (w = d * q, ternary q, one fp16 d per 256) as Q8_0: d in each of the 8 blocks. 8.5 bits where
  the files have 1.7 and 2.1.
- IQ4_XS (w = (d * sc) * table[q], IQ4_NL's table, 6-bit sc less 32 per 32 weights), IQ3_S, IQ3_XXS and
  IQ2_XXS (w = (d * u) * grid * sign: u a per-32 factor of the scale bits, 1 + 2s, (0.5 + s) / 2 or
  (0.5 + s) / 4; grid an entry of the type's grid, small integers), IQ1_S (w = (d * (2s + 1)) * (grid ± 1/8))
  and MXFP4 (w = d * q, d a power of two, q an int8 of GGUF's doubled e2m1 table) as Q8_F32 (w = d' * q',
  float32 d' and int8 q' per 32 weights). d * sc and d * u are exact in float32 (11 significant bits times 6
  or 5; IQ1_S's d' = d * (2s + 1) / 8 with q' = 8 * grid ± 1), so d' * q' rounds once where GGUF's dequantizer
  rounds (d * u) * grid once: the same value (rounding to nearest is symmetric in the sign). The grids are
  gguf's own tables. 9 bits where the files have 4.25, 3.44, 3.06, 2.06, 1.56 and 4.25.
- IQ2_XS and IQ2_S (IQ2_XXS's arithmetic with a scale per 16 weights) and IQ1_M (IQ1_S's, a scale per 16
  weights, the delta's sign per 8) as Q8_F32_16: Q8_F32 with a float32 d per 16 weights, by the same reasoning;
  NVFP4 (w = d * q, d an unsigned e4m3 halved per 16 weights, q an int8 of GGUF's doubled e2m1 table) too, d'
  = d as gguf decodes it (its NaN byte 0x7F as 0) and q' = q: d has at most 4 significant bits and q 2, so
  d * q is exact both ways. 10 bits where the files have 2.31, 2.56, 1.75 and 4.5.

Each is 3.2 to 6.4 times fewer bytes a step than float32; the loader checks every packed weight against its
float32 conversion as it does for every form, and keeps float32 where they differ (a Q4_0 d so large that -8 *
d overflows fp16, say).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
from gguf.quants import IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, MXFP4, NVFP4

from engine.kernels.cpu.invariant import WeightForm

# IQ4_NL's 16 values (GGUF's kvalues_iq4nl).
_IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


_FP16_ONE = np.array([1.0], dtype=np.float16).view(np.uint8)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A block's n bytes of nibbles [..., n] as its 2n 4-bit values in weight order: weight j in byte j's low
    nibble, weight j + n in its high one (Q4_0's, Q4_1's, IQ4_NL's, MXFP4's and NVFP4's sub-blocks' layout)."""
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


def _scale_nibbles(bytes_: np.ndarray) -> np.ndarray:
    """Bytes of 4-bit scales [..., n] as their 2n values [..., 2n]: scale i in byte i // 2, nibble i % 2."""
    return np.stack([bytes_ & 15, bytes_ >> 4], axis=-1).reshape(*bytes_.shape[:-1], -1)


def _q8_f32(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q8_F32 (or Q8_F32_16) blocks [..., 36 (20) bytes: float32 d, 32 (16) int8] from d [..., groups] and q
    [..., groups, 32 (16)]."""
    d_bytes = d.astype(np.float32)[..., None].view(np.uint8)
    blocks = np.concatenate([d_bytes, q.astype(np.int8).view(np.uint8)], axis=-1)
    return blocks.reshape(*blocks.shape[:-2], -1)


def _unit_weights(kind: GGMLQuantizationType, blocks: np.ndarray, d_at: slice) -> np.ndarray:
    """`kind`'s blocks [..., bytes] dequantized by GGUF with their fp16 d (at `d_at`) made 1, [..., weights]: each
    weight its scale factor times its integer, exact in float32."""
    ones = blocks.copy()
    ones[..., d_at] = _FP16_ONE
    flat = ones.reshape(-1, blocks.shape[-1])
    return dequantize(flat, kind).reshape(*blocks.shape[:-1], -1)


def _fp16_d(blocks: np.ndarray, d_at: slice) -> np.ndarray:
    return blocks[..., d_at].copy().view(np.float16).astype(np.float32)[..., 0]


def tq_as_q8_0(kind: GGMLQuantizationType) -> Callable[[np.ndarray], np.ndarray]:
    """TQ1_0 or TQ2_0 super-blocks [..., 54 or 66 bytes, d the last 2] as 8 Q8_0 blocks [..., 8 * 34]."""

    def rewrite(blocks: np.ndarray) -> np.ndarray:
        d_at = slice(blocks.shape[-1] - 2, blocks.shape[-1])
        q = _unit_weights(kind, blocks, d_at).astype(np.int8).reshape(*blocks.shape[:-1], 8, 32)
        d = np.broadcast_to(blocks[..., None, d_at], (*blocks.shape[:-1], 8, 2))
        return np.concatenate([d, q.view(np.uint8)], axis=-1).reshape(*blocks.shape[:-1], -1)

    return rewrite


def iq4_xs_as_q8_f32(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS super-blocks [..., 136 bytes: d, 2 bytes of the 8 scales' high 2 bits (scale i's at bits 2i), 4 of
    their low 4 bits (scale i's in byte i // 2, nibble i % 2), 8 x 16 bytes of IQ4_NL's nibbles] as 8 Q8_F32
    blocks."""
    high = blocks[..., 2:4].copy().view(np.uint16)
    i = np.arange(8)
    low = _scale_nibbles(blocks[..., 4:8])
    scales = (low | ((high >> (2 * i)) & 3).astype(np.uint8) << 4).astype(np.int8) - 32
    d = _fp16_d(blocks, slice(0, 2))[..., None] * scales.astype(np.float32)
    q = _IQ4_NL_VALUES[_nibbles(blocks[..., 8:].reshape(*blocks.shape[:-1], 8, 16))]
    return _q8_f32(d, q)


def mxfp4_as_q8_f32(blocks: np.ndarray) -> np.ndarray:
    """MXFP4 blocks [..., 17 bytes: an e8m0 exponent, 16 bytes of nibbles] as Q8_F32 blocks: d GGUF's (half the
    block's power of two), q its doubled e2m1 values."""
    d = MXFP4.e8m0_to_fp32_half(blocks[..., 0].astype(np.uint32))
    return _q8_f32(d, np.array(MXFP4.kvalues, dtype=np.int8)[_nibbles(blocks[..., 1:])])


def _grid(kind: type) -> np.ndarray:
    """A gguf IQ class's grid [entries, values] as the int8 values GGUF's dequantizer reads from it."""
    kind.init_grid()
    return np.rint(kind.grid.reshape(kind.grid_shape)).astype(np.int8)


_IQ2_XXS_GRID, _IQ2_XS_GRID, _IQ2_S_GRID, _IQ3_XXS_GRID, _IQ3_S_GRID, _IQ1_S_GRID = (
    _grid(kind) for kind in (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S)
)
_KSIGNS = np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8)
_SIGN_FIELDS = np.array([0, 7, 14, 21], dtype=np.uint32)


def _signs(bits: np.ndarray) -> np.ndarray:
    """Bytes of sign bits [...] as ±1 [..., 8] (bit i set: value i negative)."""
    return (1 - 2 * ((bits[..., None] >> np.arange(8, dtype=np.uint8)) & 1)).astype(np.int8)


def _fields_and_scale(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """IQ2_XXS's and IQ3_XXS's 32-bit words [..., 8], one a 32 weights: the signs of its 4 runs of 8 (4 7-bit
    indices into GGUF's ksigns) [..., 4, 8], and its 4-bit scale s (the top bits) as float32."""
    return _signs(_KSIGNS[(words[..., None] >> _SIGN_FIELDS) & 127]), (words >> 28).astype(np.float32)


def iq2_xxs_as_q8_f32(blocks: np.ndarray) -> np.ndarray:
    """IQ2_XXS super-blocks [..., 66 bytes: d, then per 32 weights 4 indices into its grid of 8 values and a
    word of signs and scale] as 8 Q8_F32 blocks, u = (0.5 + s) / 4."""
    groups = blocks[..., 2:].reshape(*blocks.shape[:-1], 8, 8)
    signs, scale = _fields_and_scale(groups[..., 4:].copy().view("<u4")[..., 0])
    q = _IQ2_XXS_GRID[groups[..., :4]] * signs
    d = _fp16_d(blocks, slice(0, 2))[..., None] * ((0.5 + scale) * 0.25)
    return _q8_f32(d, q.reshape(*blocks.shape[:-1], 8, 32))


def iq3_xxs_as_q8_f32(blocks: np.ndarray) -> np.ndarray:
    """IQ3_XXS super-blocks [..., 98 bytes: d, 64 indices into its grid of 4 values, 8 words of signs and
    scale] as 8 Q8_F32 blocks, u = (0.5 + s) / 2."""
    signs, scale = _fields_and_scale(blocks[..., 66:98].copy().view("<u4"))
    q = _IQ3_XXS_GRID[blocks[..., 2:66]].reshape(*blocks.shape[:-1], 8, 4, 8) * signs
    d = _fp16_d(blocks, slice(0, 2))[..., None] * ((0.5 + scale) * 0.5)
    return _q8_f32(d, q.reshape(*blocks.shape[:-1], 8, 32))


def iq3_s_as_q8_f32(blocks: np.ndarray) -> np.ndarray:
    """IQ3_S super-blocks [..., 110 bytes: d, the low 8 bits of 64 9-bit indices into its grid of 4 values, their
    high bits (index i's at bit i % 8 of byte i // 8), a sign bit a weight, 8 4-bit scales s (scale i in byte
    i // 2, nibble i % 2)] as 8 Q8_F32 blocks, u = 1 + 2s."""
    shape = blocks.shape[:-1]
    high = (blocks[..., 66:74, None] >> np.arange(8, dtype=np.uint8)) & 1
    index = blocks[..., 2:66].astype(np.uint16) | high.reshape(*shape, 64).astype(np.uint16) << 8
    q = _IQ3_S_GRID[index].reshape(*shape, 8, 32) * _signs(blocks[..., 74:106]).reshape(*shape, 8, 32)
    scale = _scale_nibbles(blocks[..., 106:110]).astype(np.float32)
    return _q8_f32(_fp16_d(blocks, slice(0, 2))[..., None] * (1 + 2 * scale), q)


def iq1_s_as_q8_f32(blocks: np.ndarray) -> np.ndarray:
    """IQ1_S super-blocks [..., 50 bytes: d, the low 8 bits of 32 11-bit indices into its grid of 8 values in
    {-1, 0, 1}, then a 16-bit word a 32 weights: 4 x 3 high index bits, a 3-bit scale s, the sign of the
    delta] as 8 Q8_F32 blocks. w = (d * (2s + 1)) * (grid ± 1/8): d' = d * (2s + 1) / 8 and q' = 8 * grid ± 1,
    exact and the same one rounding."""
    shape = blocks.shape[:-1]
    words = blocks[..., 34:50].copy().view("<u2")
    high = (words[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7
    index = blocks[..., 2:34].reshape(*shape, 8, 4).astype(np.uint16) | high << 8
    delta = np.where(words & 0x8000, -1, 1).astype(np.int8)
    q = 8 * _IQ1_S_GRID[index] + delta[..., None, None]
    d = _fp16_d(blocks, slice(0, 2))[..., None] * ((2 * (words >> 12 & 7) + 1).astype(np.float32) * 0.125)
    return _q8_f32(d, q.reshape(*shape, 8, 32))


def _per_16_scales(bytes_: np.ndarray) -> np.ndarray:
    """IQ2_XS's and IQ2_S's 8 bytes of 4-bit scales s [..., 8] as their 16 factors u = (0.5 + s) / 4, float32
    [..., 16]."""
    return (0.5 + _scale_nibbles(bytes_).astype(np.float32)) * 0.25


def iq2_xs_as_q8_f32_16(blocks: np.ndarray) -> np.ndarray:
    """IQ2_XS super-blocks [..., 74 bytes: d, 32 16-bit words (a 9-bit index into its grid of 8 values, a 7-bit
    index into GGUF's ksigns), 8 bytes of 4-bit scales] as 16 Q8_F32_16 blocks, u = (0.5 + s) / 4."""
    shape = blocks.shape[:-1]
    words = blocks[..., 2:66].copy().view("<u2")
    q = _IQ2_XS_GRID[words & 511] * _signs(_KSIGNS[words >> 9])
    d = _fp16_d(blocks, slice(0, 2))[..., None] * _per_16_scales(blocks[..., 66:74])
    return _q8_f32(d, q.reshape(*shape, 16, 16))


def iq2_s_as_q8_f32_16(blocks: np.ndarray) -> np.ndarray:
    """IQ2_S super-blocks [..., 82 bytes: d, the low 8 bits of 32 10-bit indices into its grid of 8 values, a
    sign bit a weight, their high 2 bits (index i's at bits 2 (i % 4) of byte i // 4), 8 bytes of 4-bit scales]
    as 16 Q8_F32_16 blocks, u = (0.5 + s) / 4."""
    shape = blocks.shape[:-1]
    i = np.arange(32)
    high = blocks[..., 66 + i // 4] >> (2 * (i % 4)) & 3
    index = blocks[..., 2:34].astype(np.uint16) | high.astype(np.uint16) << 8
    q = _IQ2_S_GRID[index] * _signs(blocks[..., 34:66])
    d = _fp16_d(blocks, slice(0, 2))[..., None] * _per_16_scales(blocks[..., 74:82])
    return _q8_f32(d, q.reshape(*shape, 16, 16))


def iq1_m_as_q8_f32_16(blocks: np.ndarray) -> np.ndarray:
    """IQ1_M super-blocks [..., 56 bytes: the low 8 bits of 32 11-bit indices into its grid of 8 values in {-1,
    0, 1}, a nibble an index (3 high bits, the sign of its delta), 4 16-bit words of 4 3-bit scales s each whose
    top nibbles are d's fp16 bits] as 16 Q8_F32_16 blocks. w = (d * (2s + 1)) * (grid ± 1/8), as IQ1_S's: d' =
    d * (2s + 1) / 8 and q' = 8 * grid ± 1."""
    shape = blocks.shape[:-1]
    words = blocks[..., 48:56].copy().view("<u2")
    d_bits = np.bitwise_or.reduce((words & 0xF000) >> np.array([12, 8, 4, 0], dtype=np.uint16), axis=-1)
    d = d_bits[..., None].view(np.float16).astype(np.float32)
    scales = (words[..., None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & 7
    fields = (blocks[..., 32:48, None] >> np.array([0, 4], dtype=np.uint8)).reshape(*shape, 32)
    index = blocks[..., :32].astype(np.uint16) | (fields & 7).astype(np.uint16) << 8
    delta = np.where(fields & 8, -1, 1).astype(np.int8)
    q = 8 * _IQ1_S_GRID[index] + delta[..., None]  # IQ1_M's grid is IQ1_S's (gguf's grid_hex is one object)
    u = (2 * scales.reshape(*shape, 16) + 1).astype(np.float32) * np.float32(0.125)
    return _q8_f32(d * u, q.reshape(*shape, 16, 16))


def nvfp4_as_q8_f32_16(blocks: np.ndarray) -> np.ndarray:
    """NVFP4 blocks [..., 36 bytes: 4 unsigned e4m3 scales, then 4 x 8 bytes of nibbles (sub-block s's weight j
    in byte 8s + j's low nibble, weight j + 8 in its high one)] as 4 Q8_F32_16 blocks: d GGUF's (the e4m3 value
    halved), q its doubled e2m1 values."""
    shape = blocks.shape[:-1]
    d = NVFP4.ue4m3_to_fp32(blocks[..., :4])
    nibbles = blocks[..., 4:].reshape(*shape, 4, 8)
    q = np.array(NVFP4.kvalues, dtype=np.int8)[_nibbles(nibbles)]
    return _q8_f32(d, q)


# A GGUF type → the form its blocks are rewritten as, and how: rows [N, K / block weights * block bytes].
TRANSCODED: dict[GGMLQuantizationType, tuple[WeightForm, Callable[[np.ndarray], np.ndarray]]] = {
    GGMLQuantizationType.Q4_0: (WeightForm.Q4_1, q4_0_as_q4_1),
    GGMLQuantizationType.IQ4_NL: (WeightForm.Q8_0, iq4_nl_as_q8_0),
    GGMLQuantizationType.Q3_K: (WeightForm.Q6_K, q3_k_as_q6_k),
    GGMLQuantizationType.TQ1_0: (WeightForm.Q8_0, tq_as_q8_0(GGMLQuantizationType.TQ1_0)),
    GGMLQuantizationType.TQ2_0: (WeightForm.Q8_0, tq_as_q8_0(GGMLQuantizationType.TQ2_0)),
    GGMLQuantizationType.IQ4_XS: (WeightForm.Q8_F32, iq4_xs_as_q8_f32),
    GGMLQuantizationType.MXFP4: (WeightForm.Q8_F32, mxfp4_as_q8_f32),
    GGMLQuantizationType.IQ3_S: (WeightForm.Q8_F32, iq3_s_as_q8_f32),
    GGMLQuantizationType.IQ3_XXS: (WeightForm.Q8_F32, iq3_xxs_as_q8_f32),
    GGMLQuantizationType.IQ2_XXS: (WeightForm.Q8_F32, iq2_xxs_as_q8_f32),
    GGMLQuantizationType.IQ1_S: (WeightForm.Q8_F32, iq1_s_as_q8_f32),
    GGMLQuantizationType.IQ2_XS: (WeightForm.Q8_F32_16, iq2_xs_as_q8_f32_16),
    GGMLQuantizationType.IQ2_S: (WeightForm.Q8_F32_16, iq2_s_as_q8_f32_16),
    GGMLQuantizationType.IQ1_M: (WeightForm.Q8_F32_16, iq1_m_as_q8_f32_16),
    GGMLQuantizationType.NVFP4: (WeightForm.Q8_F32_16, nvfp4_as_q8_f32_16),
}


def transcode(kind: GGMLQuantizationType, rows: np.ndarray) -> tuple[WeightForm, np.ndarray]:
    """Rows of `kind`'s blocks [N, bytes] as the form TRANSCODED names, [N, the form's bytes]."""
    form, rewrite = TRANSCODED[kind]
    blocks = rows.reshape(rows.shape[0], -1, GGML_QUANT_SIZES[kind][1])
    # A NaN d (fp16's signalling ones raise numpy's flag as they widen) stays NaN, as GGUF's dequantizer has it.
    with np.errstate(invalid="ignore"):
        return form, rewrite(blocks).reshape(rows.shape[0], -1)
