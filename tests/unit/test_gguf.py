"""GGUF files of the families llama.cpp exports, written by the tests (tests/unit/gguf_files.py) from tiny
random models: converted once through transformers' GGUF reader and served token for token as
transformers' own model of the same file, with quantized blocks kept for the batch-invariant kernels;
a file of an architecture no family serves is refused before it is converted."""

from __future__ import annotations

import itertools
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.kernels.cpu.invariant import WeightForm
from engine.model.families import UnsupportedModelError
from engine.model.gguf_index import GGUFIndex, gguf_index_file, read_gguf_index
from engine.model.loader import load_model
from engine.tiny import tiny_engine, tiny_hf_model
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.gguf_files import random_blocks, write_gguf
from tests.unit.helpers import collect, hf_greedy_logprobs

NEW_TOKENS = 16
PROMPT = list(range(20, 60))

# Config fields transformers' GGUF reader does not read take its config class's defaults (the released
# models' values): the tiny models take those where a default would not fit them (Qwen3's head size,
# Phi-3's padding id inside the vocabulary), and Gemma 2 ties its head as llama.cpp's Gemma 2 does.
OVERRIDES = {"qwen3": dict(head_dim=128), "phi3": dict(vocab_size=32064), "gemma2": dict(tie_word_embeddings=True)}


async def _served(path):
    loaded = load_model(str(path), CACHE_DIR, device="cpu", dtype="auto", batch_invariant=True)
    engine = tiny_engine(loaded)
    engine.start()
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0)
        chunks = await collect(engine, PROMPT, params)
    finally:
        engine.shutdown()
        # The conversion and the index went into the shared cache (beside the built kernels), keyed by this
        # test's file.
        shutil.rmtree(loaded.path)
        gguf_index_file(path, CACHE_DIR).unlink()
    return loaded, [(t, lp.logprob) for c in chunks for t, lp in zip(c.token_ids, c.logprobs)]


def _transformers_reading(path):
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "llama", "phi3", "qwen2", "qwen3"])
async def test_a_gguf_is_served_as_transformers_reads_it(tmp_path, model_type):
    model = tiny_hf_model(model_type, **OVERRIDES.get(model_type, {}))
    path = write_gguf(model, tmp_path / f"tiny-{model_type}.gguf")
    reference = _transformers_reading(path)
    # The file holds the model: what transformers reads back is its weights (llama.cpp's changes undone).
    assert reference.config.model_type == model_type
    original = model.state_dict()
    assert all(torch.equal(tensor, original[name]) for name, tensor in reference.state_dict().items())
    loaded, served = await _served(path)
    assert loaded.name == f"tiny-{model_type}" and loaded.model.batch_invariant
    expected = hf_greedy_logprobs(reference, PROMPT, NEW_TOKENS)
    assert [t for t, _ in served] == [t for t, _ in expected]
    assert [lp for _, lp in served] == pytest.approx([lp for _, lp in expected], abs=1e-4)


# F16 and BF16 tensors are read as float32 and kept in the 16-bit form that holds their values.
@pytest.mark.parametrize(
    "form",
    [WeightForm.Q8_0, WeightForm.Q5_0, WeightForm.Q5_1, WeightForm.F16, WeightForm.BF16],
    ids=lambda form: form.name,
)
async def test_a_quantized_gguf_s_blocks_are_kept_for_the_kernels(tmp_path, form):
    model = tiny_hf_model("qwen3", **OVERRIDES["qwen3"])
    path = write_gguf(model, tmp_path / f"tiny-qwen3-{form.name}.gguf", gguf.GGMLQuantizationType[form.name])
    loaded, served = await _served(path)
    # q/k/v/o, gate/up/down of both layers as the file's blocks (the head too: its input is 64 wide).
    forms = [packed.form for packed in loaded.model._packed.values()]
    assert forms.count(form) == 2 * 7 + 1
    expected = hf_greedy_logprobs(_transformers_reading(path), PROMPT, NEW_TOKENS)
    assert [t for t, _ in served] == [t for t, _ in expected]


@pytest.mark.parametrize(
    ("kind", "form"),
    [
        (gguf.GGMLQuantizationType.Q4_K, WeightForm.Q4_K),
        (gguf.GGMLQuantizationType.Q5_K, WeightForm.Q5_K),
        (gguf.GGMLQuantizationType.Q6_K, WeightForm.Q6_K),
        (gguf.GGMLQuantizationType.Q2_K, WeightForm.Q2_K),
        # Types the kernels read as blocks of another form (engine/model/gguf_transcode.py).
        (gguf.GGMLQuantizationType.Q4_0, WeightForm.Q4_1),
        (gguf.GGMLQuantizationType.IQ4_NL, WeightForm.Q8_0),
        (gguf.GGMLQuantizationType.Q3_K, WeightForm.Q6_K),
        (gguf.GGMLQuantizationType.TQ1_0, WeightForm.Q8_0),
        (gguf.GGMLQuantizationType.TQ2_0, WeightForm.Q8_0),
        (gguf.GGMLQuantizationType.IQ4_XS, WeightForm.Q8_F32),
        (gguf.GGMLQuantizationType.IQ3_S, WeightForm.Q8_F32),
        (gguf.GGMLQuantizationType.IQ3_XXS, WeightForm.Q8_F32),
        (gguf.GGMLQuantizationType.IQ2_XXS, WeightForm.Q8_F32),
        (gguf.GGMLQuantizationType.IQ1_S, WeightForm.Q8_F32),
        (gguf.GGMLQuantizationType.MXFP4, WeightForm.Q8_F32),
        (gguf.GGMLQuantizationType.IQ2_XS, WeightForm.Q8_F32_16),
        (gguf.GGMLQuantizationType.IQ2_S, WeightForm.Q8_F32_16),
        (gguf.GGMLQuantizationType.IQ1_M, WeightForm.Q8_F32_16),
        (gguf.GGMLQuantizationType.NVFP4, WeightForm.Q8_F32_16),
    ],
    ids=lambda value: value.name,
)
async def test_a_gguf_of_random_blocks_is_served_in_the_kernels_forms(tmp_path, kind, form):
    # Rows of 256 and 512 weights, whole super-blocks. gguf has no quantizer for the k-quants or IQ4_NL, and the
    # tiny random model's weights quantized would leave its logits close enough for the kernels' rounding to
    # change which is highest: so the file holds random blocks, whose weights spread as a trained model's, its
    # own weights, which transformers reads as it reads any.
    model = tiny_hf_model("llama", hidden_size=256, intermediate_size=512, head_dim=64)
    # A seed per tensor, so tensors of one shape (q and o, gate and up) are not the same blocks.
    seeds = itertools.count()
    path = write_gguf(
        model,
        tmp_path / f"tiny-llama-{kind.name}.gguf",
        kind,
        lambda data, _: random_blocks(kind, *data.shape, seed=next(seeds)).numpy(),
    )
    loaded, served = await _served(path)
    forms = [packed.form for packed in loaded.model._packed.values()]
    assert forms.count(form) == 2 * 7 + 1
    expected = hf_greedy_logprobs(_transformers_reading(path), PROMPT, NEW_TOKENS)
    assert [t for t, _ in served] == [t for t, _ in expected]
    assert [lp for _, lp in served] == pytest.approx([lp for _, lp in expected], abs=1e-4)


def test_a_gguf_of_an_architecture_no_family_serves_is_refused_before_converting(tmp_path):
    path = tmp_path / "tiny-bloom.gguf"
    writer = gguf.GGUFWriter(path, "bloom")
    writer.add_name("tiny-bloom")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=f"{path}: GGUF architecture 'bloom'.*not supported"):
        load_model(str(path), tmp_path / "cache", device="cpu", dtype="float32")
    # Its index was kept (the next start reads it instead of the file's metadata); nothing was converted.
    assert list((tmp_path / "cache").iterdir()) == [gguf_index_file(path, tmp_path / "cache")]


def test_the_index_read_back_maps_each_tensor_as_ggufs_reader_does(tmp_path):
    path = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny-llama.gguf")
    read = read_gguf_index(path, tmp_path)
    kept = read_gguf_index(path, tmp_path)
    assert gguf_index_file(path, tmp_path).is_file() and kept == read
    assert isinstance(kept, GGUFIndex) and kept.architecture == "llama" and kept.name is not None
    tensors = gguf.GGUFReader(path).tensors
    assert sorted(kept.tensors) == sorted(t.name for t in tensors) and len(tensors) > 10
    for tensor in tensors:
        mapped = kept.data(kept.tensors[tensor.name])
        assert kept.tensors[tensor.name].type == tensor.tensor_type
        assert mapped.dtype == tensor.data.dtype and np.array_equal(mapped, tensor.data)
    # The file rewritten is another file, whose index is read again.
    before = gguf_index_file(path, tmp_path)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert gguf_index_file(path, tmp_path) != before
