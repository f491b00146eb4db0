import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.kernels.cpu.invariant import WeightForm
from engine.model.families import ModelFolderError, UnsupportedModelError
from engine.model.loader import load_model, resolve_dtype
from engine.tiny import FAMILY_CONFIGS, tiny_engine, tiny_hf_model
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import collect, hf_greedy, tokens_of


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


# MXFP4's 4-bit values (E2M1), by code: the low three bits index the magnitude, the high one is the sign.
_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weights [E, N, K] in gpt-oss checkpoints' MXFP4 layout: blocks [E, N, K / 32, 16] (two codes a byte,
    the even element's in the low nibble), scales [E, N, K / 32] (a power of two, exponent + 127), and
    the values they hold."""
    num_experts, rows, cols = weights.shape
    groups = weights.reshape(num_experts, rows, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6.0))
    codes = (groups / torch.exp2(exponent)).unsqueeze(-1).sub(_FP4).abs().argmin(-1)
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    values = (_FP4[codes] * torch.exp2(exponent)).reshape(weights.shape)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8), values


async def test_gpt_oss_mxfp4_experts_load_widened_and_serve_what_the_checkpoint_holds(
    tmp_path, default_tokenizer, caplog
):
    model = tiny_hf_model("gpt_oss")
    quantized = {}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                parameter = getattr(layer.mlp.experts, name)
                # Stored transposed: each row of the checkpoint's blocks is an output's weights.
                blocks, scales, values = _mxfp4(parameter.transpose(1, 2))
                parameter.copy_(values.transpose(1, 2))
                key = f"model.layers.{index}.mlp.experts.{name}"
                quantized[f"{key}_blocks"], quantized[f"{key}_scales"] = blocks, scales
    model.save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    for key in {key.rsplit("_", 1)[0] for key in quantized}:
        del weights[key]
    save_file({**weights, **quantized}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    with caplog.at_level(logging.INFO, logger="engine.model.loader"):
        loaded = load_model(str(tmp_path), CACHE_DIR, device="cpu", dtype="auto", batch_invariant=True)
    assert "the experts' MXFP4 weights are widened to float32 at load" in caplog.text
    # MXFP4's values are bfloat16's: the kernels keep them so.
    assert {kernel.gate_up.form for kernel in loaded.model._experts.values()} == {WeightForm.BF16}
    engine = tiny_engine(loaded)
    engine.start()
    try:
        prompt = list(range(20, 60))
        chunks = await collect(engine, prompt, SamplingParams(max_tokens=16, temperature=0.0))
    finally:
        engine.shutdown()
    assert tokens_of(chunks) == hf_greedy(model, prompt, 16)


async def test_a_vision_checkpoint_no_vision_family_serves_serves_its_language_model_alone(
    tmp_path, default_tokenizer, caplog
):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    # Mistral Small 3.1's layout (mistral3: a Pixtral tower over a Mistral), whose images Sluice does not serve.
    text = dict(FAMILY_CONFIGS["mistral"], model_type="mistral", vocab_size=512, hidden_size=64, intermediate_size=128)
    text.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=16)
    config = Mistral3Config(
        text_config=text,
        vision_config=dict(vision, num_attention_heads=2, image_size=28, patch_size=14),
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)

    with caplog.at_level(logging.INFO, logger="engine.model.loader"):
        loaded = load_model(str(tmp_path), CACHE_DIR, device="cpu", dtype="auto", batch_invariant=True)
    assert "a mistral3 checkpoint's language model (mistral) is served, its images are not" in caplog.text
    assert loaded.model.family.config.model_type == "mistral" and loaded.model.batch_invariant
    assert loaded.model.vision is None
    engine = tiny_engine(loaded)
    engine.start()
    try:
        prompt = list(range(20, 60))
        chunks = await collect(engine, prompt, SamplingParams(max_tokens=16, temperature=0.0))
    finally:
        engine.shutdown()
    assert tokens_of(chunks) == hf_greedy(model, prompt, 16)
