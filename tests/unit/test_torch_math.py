"""The kernels' copies of torch's float32 arithmetic (torch_math.h) give torch's AVX2 bits on this CPU, whatever
torch itself dispatches to here: the recorded reference outputs hold on AVX2 and AVX-512 machines alike."""

import os
import subprocess
import sys

import pytest
import torch

from engine.kernels.cpu.native import load_library
from engine.kernels.cpu.sampling import log_softmax_on_cpu
from tests.conftest import CACHE_DIR

# Vocabularies: a whole number of 8-lane vectors, a tail, fewer than one vector; the default model's.
VOCABS = (49152, 1000, 257, 13, 5)
SCALES = (1.0, 6.0, 40.0)


@pytest.fixture(scope="module")
def library():
    library = load_library(CACHE_DIR)
    assert library is not None, "these tests run where the kernels do: x86-64 with AVX2"
    return library


def logits(vocab: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(vocab)
    rows = torch.randn(24, vocab, generator=generator) * scale
    rows[0, 3 % vocab] = 1e4  # one dominant token: the sum is exp(0) and underflows
    return rows


def test_log_softmax_is_torchs_avx2_log_softmax(library, tmp_path):
    # torch's AVX2 kernels, forced in a process of their own: the reference bits.
    script = (
        "import sys, torch\n"
        "from tests.unit.test_torch_math import logits, VOCABS, SCALES\n"
        "torch.save({(v, s): logits(v, s).log_softmax(-1) for v in VOCABS for s in SCALES}, sys.argv[1])\n"
    )
    reference = tmp_path / "avx2.pt"
    subprocess.run(
        [sys.executable, "-c", script, str(reference)], check=True, env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    )
    expected = torch.load(reference)
    for (vocab, scale), want in expected.items():
        x = logits(vocab, scale)
        assert torch.equal(log_softmax_on_cpu(library, x), want), (vocab, scale)
        # Rows strided as the sampler hands them over: one row alone is the same row.
        assert torch.equal(log_softmax_on_cpu(library, x[5:6]), want[5:6])
