import pytest
import torch

from engine.model.families import UnsupportedModelError
from engine.model.loader import load_model, resolve_dtype
from engine.tiny import FAMILY_CONFIGS, tiny_hf_model
from tests.conftest import CACHE_DIR


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_any_local_hf_folder_loads(tmp_path, default_tokenizer, model_type):
    tiny_hf_model(model_type).save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), CACHE_DIR, device="cpu", dtype="float32")
    assert loaded.name == tmp_path.name
    assert loaded.model.num_layers == 2 and loaded.model.dtype == torch.float32
    assert default_tokenizer.eos_token_id in loaded.eos_token_ids
    assert len(loaded.token_bytes) >= 512


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path), tmp_path, device="cpu", dtype="auto")


def test_an_unsupported_architecture_is_refused(tmp_path, default_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError):
        load_model(str(tmp_path), tmp_path, device="cpu", dtype="float32")


def test_explicit_dtype_wins_and_cuda_defaults_to_bf16():
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu"), batch_invariant=True) == torch.float32


def test_batch_invariant_loading_moves_every_linear_layer_onto_the_kernels(tmp_path, default_tokenizer):
    tiny_hf_model().save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), CACHE_DIR, device="cpu", dtype="auto", batch_invariant=True)
    assert loaded.model.kernels is not None and loaded.model.dtype == torch.float32
    # Two layers of q, k, v, o, gate, up, down, and the head.
    assert len(loaded.model._packed) == 2 * 7 + 1
    bf16 = load_model(str(tmp_path), CACHE_DIR, device="cpu", dtype="bfloat16", batch_invariant=True)
    assert bf16.model.kernels is None


def test_mistral_with_a_sliding_window_serves_its_whole_context_through_the_window(tmp_path, default_tokenizer):
    tiny_hf_model("mistral").save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), CACHE_DIR, device="cpu", dtype="auto")
    window = FAMILY_CONFIGS["mistral"]["sliding_window"]
    assert loaded.max_position_embeddings == 1024 > window
    assert loaded.model.family.windows == (window, window)
