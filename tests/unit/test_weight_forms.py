"""The batch-invariant linear kernel over weights kept as they ship (GGUF Q8_0, Q4_1, Q5_0, Q5_1, Q2_K, Q4_K, Q5_K
and Q6_K blocks, the Q8_F32 and Q8_F32_16 ones that other GGUF types are rewritten as, bfloat16, float16):
bit for bit the float32 kernel over the same weights converted to float32 as the loader converts them
(GGUF's own dequantizer; bfloat16 widened), for any number of rows, odd shapes and tails, in the vector
and the scalar variant alike."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.kernels.cpu.invariant import BLOCK_BYTES, BLOCK_WEIGHTS, PackedEmbedding, PackedLinear, WeightForm
from engine.kernels.cpu.native import load_library
from engine.model.loader import load_model
from engine.tiny import tiny_hf_model
from tests.conftest import CACHE_DIR
from tests.unit.gguf_files import dequantized, random_blocks

SHAPES = [(576, 576), (100, 64), (1, 32), (17, 96), (1536, 160), (49152, 64)]
# A Q4_K_M (Q5_K_M) file's Q5_0 (Q5_1) tensors: rows of 576 and 1536, whose K is no multiple of 256.
FIVE_BIT_SHAPES = [(1536, 576), (577, 1536), (100, 64), (1, 32), (17, 96)]
# The k-quants' super-blocks span 256 weights of K; N is no multiple of a panel's 16 columns.
SUPER_BLOCK_SHAPES = [(100, 256), (17, 512), (1, 1536), (577, 1536), (8200, 256)]
K_QUANTS = (WeightForm.Q4_K, WeightForm.Q5_K, WeightForm.Q6_K, WeightForm.Q2_K)
FIVE_BITS = (WeightForm.Q5_0, WeightForm.Q5_1)
# Q8_F32_16's groups of 16: a K of an odd number of them too.
SIXTEENS_SHAPES = [*SHAPES, (33, 48), (1, 16)]


@pytest.fixture(scope="module")
def library():
    library = load_library(CACHE_DIR)
    assert library is not None, "these tests run where the kernels do: x86-64 with AVX2"
    return library


def assert_same_bits(library, packed: PackedLinear, weight: torch.Tensor) -> None:
    reference = PackedLinear.pack(library, weight)
    scalar = dataclasses.replace(packed, scalar=True)
    torch.manual_seed(packed.out_features)
    x = torch.randn(300, packed.in_features)
    full = reference(x)
    torch.testing.assert_close(full, x @ weight.T, rtol=1e-4, atol=1e-3)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 16, 17, 64, 255):
        for offset in (0, 45):
            assert torch.equal(packed(x[offset : offset + rows]), full[offset : offset + rows]), (rows, offset)
    few = x[:7] if packed.out_features < 10000 else x[:2]
    assert torch.equal(scalar(few), full[: few.shape[0]])
    out, maxima = packed.with_block_max(x[:5])
    assert torch.equal(out, full[:5]) and torch.equal(maxima, reference.with_block_max(x[:5])[1])


@pytest.mark.parametrize(
    ("form", "out_features", "in_features"),
    [
        *((form, *shape) for form in (WeightForm.Q8_0, WeightForm.Q4_1, WeightForm.Q8_F32) for shape in SHAPES),
        *((form, *shape) for form in FIVE_BITS for shape in FIVE_BIT_SHAPES),
        *((form, *shape) for form in K_QUANTS for shape in SUPER_BLOCK_SHAPES),
        *((WeightForm.Q8_F32_16, *shape) for shape in SIXTEENS_SHAPES),
    ],
    ids=lambda value: getattr(value, "name", str(value)),
)
def test_gguf_blocks_give_the_float32_kernels_bits(library, form, out_features, in_features):
    blocks = random_blocks(form, out_features, in_features)
    weight = torch.from_numpy(dequantized(form, blocks.numpy()).reshape(out_features, in_features))
    packed = PackedLinear.pack_blocks(library, form, blocks, out_features, in_features)
    # The blocks' own bytes, the last panel's columns padded to 16 (Q4_K's and Q5_K's sub-block scales and
    # minimums take a byte each, 16 of a block's bytes where they were 12; Q2_K's take a byte each where they
    # shared one, and its 2-bit values a nibble each: 164 where there were 84).
    block_bytes = BLOCK_BYTES[form] + {WeightForm.Q4_K: 4, WeightForm.Q5_K: 4, WeightForm.Q2_K: 80}.get(form, 0)
    assert packed.panels.numel() == -(-out_features // 16) * 16 * in_features // BLOCK_WEIGHTS[form] * block_bytes
    assert_same_bits(library, packed, weight)


@pytest.mark.parametrize(("out_features", "in_features"), [*SHAPES, (33, 7), (5, 301)])
@pytest.mark.parametrize(("dtype", "form"), [(torch.bfloat16, WeightForm.BF16), (torch.float16, WeightForm.F16)])
def test_16_bit_weights_give_the_float32_kernels_bits(library, out_features, in_features, dtype, form):
    torch.manual_seed(in_features)
    weight = torch.randn(out_features, in_features).to(dtype)
    packed = PackedLinear.pack(library, weight)
    assert packed.form == form and packed.panels.numel() == -(-out_features // 16) * 16 * in_features * 2
    assert_same_bits(library, packed, weight.float())


def test_every_float16_widens_exactly(library):
    # All 65,536 halves (subnormals, infinities and NaNs among them) as a weight [4096, 16].
    halves = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).reshape(4096, 16)
    packed = PackedLinear.pack(library, halves)
    assert packed.form == WeightForm.F16
    assert torch.equal(packed.unpacked().view(torch.int32), halves.float().view(torch.int32))
    # Through the kernels: x = I picks each weight out of its chain (0 * w adds +0), where a row's weights are all
    # finite (elsewhere 0 * inf is NaN).
    finite = halves.float().isfinite().all(dim=1)
    x = torch.eye(16)
    for kernel in (packed, dataclasses.replace(packed, scalar=True)):
        assert torch.equal(kernel(x).T[finite], halves.float()[finite])


@pytest.mark.parametrize(("out_features", "in_features"), [(100, 40), (33, 7)])
def test_the_scalar_variant_gives_the_vector_variants_bits_over_float32(library, out_features, in_features):
    torch.manual_seed(1)
    weight = torch.randn(out_features, in_features)
    packed = PackedLinear.pack(library, weight)
    x = torch.randn(9, in_features)
    assert torch.equal(dataclasses.replace(packed, scalar=True)(x), packed(x))


def test_blocks_of_the_wrong_shape_are_refused(library):
    with pytest.raises(ValueError):
        PackedLinear.pack_blocks(library, WeightForm.Q4_1, torch.zeros(4, 20, dtype=torch.uint8), 4, 40)


@pytest.mark.parametrize(
    "form",
    [WeightForm.Q4_1, WeightForm.Q8_F32, WeightForm.Q8_F32_16, *FIVE_BITS, *K_QUANTS],
    ids=lambda form: form.name,
)
def test_unpacked_gives_the_values_the_kernel_widens_to(library, form):
    blocks = random_blocks(form, 40, 512)
    packed = PackedLinear.pack_blocks(library, form, blocks, 40, 512)
    expected = torch.from_numpy(dequantized(form, blocks.numpy()))
    assert torch.equal(packed.unpacked().view(torch.int32), expected.view(torch.int32))
    # As a tied head's rows read back as the input embedding.
    ids = torch.tensor([[0, 17, 39], [5, 5, 16]])
    assert torch.equal(PackedEmbedding(packed)(ids).view(torch.int32), expected[ids].view(torch.int32))
    for weight in (torch.randn(33, 7).bfloat16(), torch.randn(33, 7).half()):
        assert torch.equal(PackedLinear.pack(library, weight).unpacked(), weight.float())


def test_a_16_bit_checkpoint_stays_16_bit_and_a_float32_one_float32(tmp_path, default_tokenizer):
    hf = tiny_hf_model()
    float32 = load_model(*_saved(hf, tmp_path / "f32", default_tokenizer))
    assert {p.form for p in float32.model._packed.values()} == {WeightForm.F32}
    for dtype, form in ((torch.bfloat16, WeightForm.BF16), (torch.float16, WeightForm.F16)):
        narrow = copy.deepcopy(hf).to(dtype)
        loaded = load_model(*_saved(narrow, tmp_path / str(dtype), default_tokenizer))
        assert {p.form for p in loaded.model._packed.values()} == {form}
        assert loaded.model.dtype == torch.float32
        # The kernel computes with the checkpoint's own values.
        for loaded_layer, layer in zip(loaded.model.layers, narrow.model.layers, strict=True):
            for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
                packed = loaded.model._packed[loaded_layer.get_submodule(name)]
                assert torch.equal(packed.unpacked(), layer.get_submodule(name).weight.float())


def test_a_16_bit_mixture_of_experts_keeps_its_experts_and_routers_16_bit(tmp_path, default_tokenizer):
    for dtype, form in ((torch.bfloat16, WeightForm.BF16), (torch.float16, WeightForm.F16)):
        loaded = load_model(*_saved(tiny_hf_model("mixtral").to(dtype), tmp_path / str(dtype), default_tokenizer))
        kernels = list(loaded.model._experts.values())
        assert len(kernels) == 2
        assert {k.gate_up.form for k in kernels} == {k.down.form for k in kernels} == {k.router.form for k in kernels}
        assert {k.gate_up.form for k in kernels} == {form}


def _saved(hf, folder, tokenizer) -> tuple:
    """load_model's arguments for `hf` saved in `folder`: the session's cache, where the kernels are built."""
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), CACHE_DIR, "cpu", "auto", True


def test_a_tied_head_serves_as_the_input_embedding_and_the_checkpoint_is_unmapped(tmp_path, default_tokenizer):
    hf = tiny_hf_model(repetitive=True)  # tied embeddings
    loaded = load_model(*_saved(hf, tmp_path / "tied", default_tokenizer))
    embeddings = loaded.model.embed_tokens
    assert isinstance(embeddings, PackedEmbedding)
    assert loaded.model.lm_head.weight.numel() == 0  # the float32 table is freed
    ids = torch.tensor([[0, 5, 511], [7, 7, 300]])
    assert torch.equal(embeddings(ids).view(torch.int32), hf.get_input_embeddings()(ids).view(torch.int32))
    for outside in (512, -1):
        with pytest.raises(IndexError, match="outside the vocabulary of 512"):
            embeddings(torch.tensor([3, outside]))
    # No parameter left in the checkpoint's memory map, which would keep the whole file resident.
    assert str(tmp_path / "tied" / "model.safetensors") not in Path("/proc/self/maps").read_text()
    untied = load_model(*_saved(tiny_hf_model(), tmp_path / "untied", default_tokenizer))
    assert type(untied.model.embed_tokens) is torch.nn.Embedding


@pytest.mark.slow
def test_the_default_models_tied_head_gives_its_float32_embedding_bit_for_bit(default_model_path):
    with safe_open(default_model_path / "model.safetensors", "pt") as checkpoint:
        expected = checkpoint.get_tensor("model.embed_tokens.weight")
    loaded = load_model(None, CACHE_DIR, "cpu", "auto", True)
    embeddings = loaded.model.embed_tokens
    assert isinstance(embeddings, PackedEmbedding)
    assert embeddings.head.form == WeightForm.Q8_0
    every_id = torch.arange(expected.shape[0])
    assert torch.equal(embeddings(every_id).view(torch.int32), expected.view(torch.int32))
