import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.families import ModelFolderError, UnsupportedModelError
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
    with pytest.raises(ModelFolderError, match="no config.json"):
        load_model(str(tmp_path), tmp_path, device="cpu", dtype="auto")


def _drop_config_field(folder, field):
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    del config[field]
    config_file.write_text(json.dumps(config))


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "num_hidden_layers"])
def test_a_config_lacking_a_needed_field_is_refused_naming_file_and_field(tmp_path, field):
    # Without num_hidden_layers transformers would build its default 32 layers, 30 of them random.
    tiny_hf_model().save_pretrained(tmp_path)
    _drop_config_field(tmp_path, field)
    with pytest.raises(ModelFolderError, match=f"config.json lacks '{field}', which llama needs"):
        load_model(str(tmp_path), tmp_path, device="cpu", dtype="float32")


def test_a_shard_missing_from_the_folder_is_refused_naming_it(tmp_path):
    tiny_hf_model().save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(ModelFolderError, match=f"model.safetensors.index.json names {shard}, not in the folder"):
        load_model(str(tmp_path), tmp_path, device="cpu", dtype="float32")


def test_a_folder_without_weights_is_refused(tmp_path):
    tiny_hf_model().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelFolderError, match="has no weights"):
        load_model(str(tmp_path), tmp_path, device="cpu", dtype="float32")


def test_weights_lacking_a_tensor_are_refused_not_filled_at_random(tmp_path, default_tokenizer):
    tiny_hf_model().save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelFolderError, match="lack 1 tensor.* model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path), tmp_path, device="cpu", dtype="float32")


def test_the_server_exits_non_zero_with_the_refusal_in_one_line(tmp_path):
    tiny_hf_model().save_pretrained(tmp_path)
    _drop_config_field(tmp_path, "num_hidden_layers")
    command = [sys.executable, "-m", "app", "--model", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"{tmp_path / 'config.json'} lacks 'num_hidden_layers', which llama needs" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


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
