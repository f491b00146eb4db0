"""GGUF types the kernels read as blocks of another form (engine/model/gguf_transcode.py): GGUF's own
dequantizer gives the rewritten blocks the original's float32 values, bit for bit (zeros of either sign alike,
as the loader's check takes them), whatever their bytes; where a rewrite cannot hold a block's values, the
loader's check sees it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.kernels.cpu.invariant import BLOCK_BYTES, BLOCK_WEIGHTS
from engine.model.gguf_transcode import TRANSCODED, transcode
from engine.model.invariant_kernels import same_weights
from tests.unit.gguf_files import TRANSCODED_SCALE_BYTES, dequantized, set_iq1_m_d

Q4_0 = gguf.GGMLQuantizationType.Q4_0


def _dequantized(kind: gguf.GGMLQuantizationType, d_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of random blocks of `kind` with these fp16 scales d (one per block, as bits; MXFP4's exponent byte
    takes the low 8 bits, NVFP4's first e4m3 scale too; IQ1_M's spreads over its scale words), dequantized as
    they are and as rewritten."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows = np.random.default_rng(0).integers(0, 256, (len(d_bits), block_bytes), dtype=np.uint8)
    if kind.name in TRANSCODED_SCALE_BYTES:
        rows[:, TRANSCODED_SCALE_BYTES[kind.name]] = d_bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    elif kind.name == "IQ1_M":
        set_iq1_m_d(rows, d_bits.astype(np.uint16).view(np.float16))
    else:
        rows[:, 0] = d_bits & 255
    form, rewritten = transcode(kind, rows)
    assert rewritten.dtype == np.uint8
    assert rewritten.shape == (len(d_bits), block_weights // BLOCK_WEIGHTS[form] * BLOCK_BYTES[form])
    with np.errstate(invalid="ignore", over="ignore"):
        original = gguf.quants.dequantize(rows, kind)
        widened = dequantized(form, rewritten)
    assert original.shape == widened.shape == (len(d_bits), block_weights)
    return original, widened


@pytest.mark.parametrize("kind", list(TRANSCODED), ids=lambda kind: kind.name)
def test_rewritten_blocks_dequantize_to_the_same_bits(kind):
    # Every fp16 d (zeros of either sign, subnormals, infinities and NaNs among them; for Q4_0 the finite ones
    # below 8192, past which its rewrite cannot hold d: the next test), every other byte drawn.
    d_bits = np.arange(1 << 16)
    if kind == Q4_0:
        d_bits = d_bits[(d_bits & 0x7FFF) < 28 << 10]
    original, widened = _dequantized(kind, d_bits)
    assert same_weights(torch.from_numpy(widened), torch.from_numpy(original))
    # Only Q4_0's rewrite turns some -0 into +0 (its zero weights: q = 8, or d zero); every other bit is kept.
    differ = original.view(np.uint32) != widened.view(np.uint32)
    assert set(original[differ].view(np.uint32)) <= {0x80000000}
    assert differ.any() == (kind == Q4_0)


def test_a_q4_0_block_whose_offset_overflows_fp16_is_seen_to_differ():
    # -8 * d overflows fp16 from d = 8192: the loader keeps such a tensor in float32.
    for d in (8192.0, 65504.0, float("inf")):
        original, widened = _dequantized(Q4_0, np.array([d], dtype=np.float16).view(np.uint16))
        assert not same_weights(torch.from_numpy(widened), torch.from_numpy(original))


def test_same_weights_takes_zeros_of_either_sign_alike_and_nothing_else():
    def same(a: list[float], b: list[float]) -> bool:
        return same_weights(torch.tensor(a), torch.tensor(b))

    assert same([0.0, -0.0, 1.5], [-0.0, 0.0, 1.5])
    assert not same([0.0], [1e-45]) and not same([-0.0], [-1e-45]) and not same([1.0], [-1.0])
    nan = torch.tensor([float("nan")])
    assert same_weights(nan, nan.clone()) and not same_weights(nan, -nan)
