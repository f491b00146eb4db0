"""Every variant of the CPU kernels this CPU runs (native.py: avx2-fma, avx512) gives the same bits, the linear
kernel over each weight form and the decoder layers in one call alike; and the variant chosen at start."""

import dataclasses

import pytest
import torch

from engine.kernels.cpu.invariant import BLOCK_WEIGHTS, FLOAT_DTYPES, PackedLinear, WeightForm
from engine.kernels.cpu.native import load_library, runnable_variants
from engine.model.teacher_forcing import teacher_forced_logits
from engine.tiny import tiny_engine, tiny_loaded
from tests.conftest import CACHE_DIR
from tests.unit.gguf_files import random_weight_source
from tests.unit.test_decoder import _random_norms

SHAPES = [(576, 576), (17, 96), (1536, 160), (49152, 64)]
# The k-quants' super-blocks span 256 weights of K.
SUPER_BLOCK_SHAPES = [(576, 512), (17, 256), (8200, 256)]

VARIANTS = runnable_variants()
pytestmark = pytest.mark.skipif(len(VARIANTS) < 2, reason="this CPU runs one variant of the kernels")


@pytest.fixture(scope="module")
def libraries():
    libraries = [load_library(CACHE_DIR, variant) for variant in VARIANTS]
    assert [library.sl_variant().decode() for library in libraries] == [v.name for v in VARIANTS]
    return libraries


def _packed(library, form: WeightForm, out_features: int, in_features: int) -> PackedLinear:
    source = random_weight_source(form, out_features, in_features)
    if form in FLOAT_DTYPES:
        return PackedLinear.pack(library, source)
    return PackedLinear.pack_blocks(library, form, source, out_features, in_features)


@pytest.mark.parametrize(
    ("form", "out_features", "in_features"),
    [
        (form, *shape)
        for form in WeightForm
        for shape in (SUPER_BLOCK_SHAPES if BLOCK_WEIGHTS.get(form) == 256 else SHAPES)
    ],
    ids=lambda value: getattr(value, "name", str(value)),
)
def test_every_variant_gives_the_same_linear_bits(libraries, form, out_features, in_features):
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(out_features))
    first, *others = (_packed(library, form, out_features, in_features) for library in libraries)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 64, 255):
        expected = first(x[:rows])
        assert all(torch.equal(other(x[:rows]), expected) for other in others), rows
    out, maxima = first.with_block_max(x[:5])
    for other in others:
        assert all(map(torch.equal, other.with_block_max(x[:5]), (out, maxima)))
        assert torch.equal(dataclasses.replace(other, scalar=True)(x[:3]), out[:3])


def test_every_variant_gives_the_same_decoder_bits(libraries, default_tokenizer):
    loaded = tiny_loaded(default_tokenizer, "qwen2", kernels_cache=CACHE_DIR)
    model = loaded.model
    _random_norms(model)
    decoder, packed = model._decoder, dict(model._packed)
    prompt = list(range(3, 60))
    logits = []
    for library in libraries:
        linears = {module: dataclasses.replace(linear, library=library) for module, linear in packed.items()}
        model.use_kernels(library, linears, None, dataclasses.replace(decoder, library=library))
        logits.append(teacher_forced_logits(tiny_engine(loaded), prompt))
    assert all(torch.equal(other, logits[0]) for other in logits[1:])
