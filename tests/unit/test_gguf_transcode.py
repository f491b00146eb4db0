"""GGUF types the kernels read as blocks of another form (engine/model/gguf_transcode.py): GGUF's own
dequantizer gives the rewritten blocks the original's float32 values, bit for bit, whatever their bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.model.gguf_transcode import TRANSCODED, transcode
from tests.unit.gguf_files import TRANSCODED_SCALE_BYTES


@pytest.mark.parametrize("kind", list(TRANSCODED), ids=lambda kind: kind.name)
def test_rewritten_blocks_dequantize_to_the_same_bits(kind):
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    # Every byte drawn, the fp16 scales d too; the first blocks' d the edges of fp16.
    rows = np.random.default_rng(0).integers(0, 256, (512, 3 * block_bytes), dtype=np.uint8)
    edges = np.array([-0.0, 0.0, np.inf, -np.inf, np.nan, 6e-8, -6e-5, 65504], dtype=np.float16)
    rows[: len(edges), TRANSCODED_SCALE_BYTES[kind.name]] = edges.view(np.uint8).reshape(-1, 2)
    form, rewritten = transcode(kind, rows)
    assert rewritten.dtype == np.uint8
    assert rewritten.shape == (512, 3 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[form.name]][1])
    with np.errstate(invalid="ignore"):
        original = gguf.quants.dequantize(rows, kind)
        widened = gguf.quants.dequantize(rewritten, gguf.GGMLQuantizationType[form.name])
    assert original.shape == widened.shape == (512, 3 * block_weights)
    assert np.array_equal(original.view(np.uint32), widened.view(np.uint32))
    assert (original.view(np.uint32) == 0x80000000).any() and np.isnan(original).any()
