"""Tiny GGUF files written from Hugging Face models as llama.cpp's convert script writes them, for the
tests of GGUF loading: the architecture's metadata under llama.cpp's keys (those transformers' GGUF
reader maps back), a small byte-level BPE tokenizer, and every tensor under its GGUF
name, changed as llama.cpp changes it (Llama's q and k rows interleaved per rotary head, Gemma's norm
weights stored as 1 + weight), in float32 or in GGUF's quantized blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

from engine.kernels.cpu.invariant import BLOCK_BYTES, BLOCK_WEIGHTS, FLOAT_DTYPES, SCALE_BYTES, WeightForm

# The byte-level alphabet: each byte's character, in byte order.
BYTES = [bytes_to_unicode()[byte] for byte in range(256)]

# A Hugging Face model_type → the GGUF architecture llama.cpp writes it as.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}


def write_gguf(
    model: PreTrainedModel,
    path: Path,
    quantization: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    quantize: Callable[[np.ndarray, gguf.GGMLQuantizationType], np.ndarray] = gguf.quants.quantize,
) -> Path:
    """`model` as a GGUF file at `path`: its 2D weights whose rows are whole blocks in `quantization`'s blocks
    (as `quantize` writes them: gguf's quantizer, which has none for the k-quants), the rest float32."""
    config = model.config
    architecture = ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name(f"tiny-{config.model_type}")
    for key, attribute in GGUF_CONFIG_MAPPING[architecture].items():
        value = _config_value(config, attribute)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            writer.add_uint32(f"{architecture}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{architecture}.{key}", value)
    _add_tokenizer(writer)
    names = gguf.get_tensor_name_map(_arch_enum(architecture), config.num_hidden_layers)
    tied = config.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp writes no output projection where it is the embedding matrix
        base, suffix = hf_name.rsplit(".", 1)
        if names.get_name(base) is None:
            raise ValueError(f"llama.cpp's {architecture} has no tensor for {hf_name}")
        gguf_name = f"{names.get_name(base)}.{suffix}"
        data = tensor.detach().float().numpy()
        if architecture == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            data = _permute(data, heads)
        if architecture.startswith("gemma") and gguf_name.endswith("norm.weight"):
            data = data + 1
        block = gguf.GGML_QUANT_SIZES[quantization][0]
        if data.ndim == 2 and quantization != gguf.GGMLQuantizationType.F32 and data.shape[1] % block == 0:
            writer.add_tensor(gguf_name, quantize(data, quantization), raw_dtype=quantization)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _config_value(config, attribute: str | None):
    if attribute is None:
        return None
    if attribute == "rope_theta":
        return float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    return getattr(config, attribute, None)


def _arch_enum(architecture: str) -> gguf.MODEL_ARCH:
    return next(arch for arch, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)


def _permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of each rotary head's rows (what transformers' reader undoes)."""
    half_head = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half_head, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """A byte-level BPE tokenizer (GPT-2's kind, as Qwen's and SmolLM's are) of the 256 bytes, one merge and
    three special tokens: small, since transformers' reader parses a vocabulary's metadata token by token."""
    tokens = [*BYTES, "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 3)
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))


# The fp16 scales' spread, by GGUF type: the k-quants' weights then spread about as a tiny model's (0.2), since
# a model of them (tests/unit/test_gguf.py) would otherwise amplify rounding differences from layer to layer.
SCALE_SPREAD = {
    "Q8_0": 0.05,
    "Q4_1": 0.05,
    "Q5_0": 0.025,
    "Q5_1": 0.025,
    "Q4_K": 6e-4,
    "Q5_K": 3e-4,
    "Q6_K": 1.5e-4,
    "Q2_K": 0.01,
    "Q4_0": 0.05,
    "IQ4_NL": 4e-3,
    "Q3_K": 6e-3,
    "TQ1_0": 0.1,
    "TQ2_0": 0.1,
    "IQ4_XS": 2.5e-4,
    "IQ3_S": 1.5e-3,
    "IQ3_XXS": 1.7e-3,
    "IQ2_XXS": 4e-3,
    "IQ1_S": 0.02,
    "Q8_F32": 0.05,
    "Q8_F32_16": 0.05,
    "IQ2_XS": 4e-3,
    "IQ2_S": 4e-3,
}
# Where the GGUF types the kernels take as blocks of another form (engine/model/gguf_transcode.py) keep their
# fp16 scale d (MXFP4's is an exponent byte, its first).
TRANSCODED_SCALE_BYTES = {
    "Q4_0": slice(0, 2),
    "IQ4_NL": slice(0, 2),
    "Q3_K": slice(108, 110),
    "TQ1_0": slice(52, 54),
    "TQ2_0": slice(64, 66),
    "IQ4_XS": slice(0, 2),
    "IQ3_S": slice(0, 2),
    "IQ3_XXS": slice(0, 2),
    "IQ2_XXS": slice(0, 2),
    "IQ1_S": slice(0, 2),
    "IQ2_XS": slice(0, 2),
    "IQ2_S": slice(0, 2),
}


def set_iq1_m_d(blocks: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M blocks [..., 56 bytes] given the fp16 d [...]: its bits in the top nibbles of the 4 scale words (the
    first word's its lowest 4)."""
    words = blocks[..., 48:56].copy().view("<u2") & 0x0FFF
    words |= (d.view(np.uint16)[..., None] >> np.array([0, 4, 8, 12], dtype=np.uint16) & 15) << 12
    blocks[..., 48:56] = words.view(np.uint8)


def random_blocks(
    kind: WeightForm | gguf.GGMLQuantizationType, out_features: int, in_features: int, seed: int = 0
) -> torch.Tensor:
    """GGUF blocks of `kind` (a form's, or a GGUF type's) with random fp16 scales (and offsets, or minimums'
    scales) and every other byte drawn: the quantized values and the k-quants' sub-block scales, any of whose
    bits are valid. The same shape and `seed` draw the same blocks. Q8_F32's and Q8_F32_16's scales are
    float32, MXFP4's exponents 2^-7 to 2^-5, NVFP4's scales (e4m3, halved as GGUF reads them) under 2^-5,
    IQ1_M's d (fp16 bits in its scale words' top nibbles) IQ1_S's spread."""
    form = WeightForm.__members__.get(kind.name)
    if form is not None:
        block_weights, block_bytes = BLOCK_WEIGHTS[form], BLOCK_BYTES[form]
    else:
        block_weights, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = out_features * in_features // block_weights
    generator = np.random.default_rng(out_features * 7919 + in_features + 104729 * seed)
    data = generator.integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
    if kind.name == "MXFP4":
        data[:, 0] = generator.integers(121, 124, blocks)
    elif kind.name == "NVFP4":
        data[:, :4] = generator.integers(0, 24, (blocks, 4))
    elif kind.name == "IQ1_M":
        set_iq1_m_d(data, (generator.standard_normal(blocks) * SCALE_SPREAD["IQ1_S"]).astype(np.float16))
    elif form in (WeightForm.Q8_F32, WeightForm.Q8_F32_16):
        scales = (generator.standard_normal((blocks, 1)) * SCALE_SPREAD[kind.name]).astype(np.float32)
        data[:, :4] = scales.view(np.uint8)
    else:
        halves = (generator.standard_normal((blocks, 2)) * SCALE_SPREAD[kind.name]).astype(np.float16)
        where = SCALE_BYTES[form] if form is not None else TRANSCODED_SCALE_BYTES[kind.name]
        data[:, where] = halves.view(np.uint8)[:, : where.stop - where.start]
    return torch.from_numpy(data.reshape(out_features, -1).copy())


def dequantized(form: WeightForm, blocks: np.ndarray) -> np.ndarray:
    """Rows of `form`'s blocks [N, bytes] as the loader converts them, [N, weights]: GGUF's dequantizer, or
    Q8_F32's and Q8_F32_16's d * q (GGUF has no such types)."""
    if form not in (WeightForm.Q8_F32, WeightForm.Q8_F32_16):
        return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[form.name])
    rows = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES[form])
    d = rows[..., :4].copy().view(np.float32)
    return (d * rows[..., 4:].view(np.int8).astype(np.float32)).reshape(blocks.shape[0], -1)


def random_weight_source(form: WeightForm, out_features: int, in_features: int) -> torch.Tensor:
    """What sl_pack packs into `form`: a random float32, bfloat16 or float16 weight [N, K] (float16's every fifth
    value one of its subnormals, zeros or largest finite values in turn), or random GGUF blocks."""
    if form in FLOAT_DTYPES:
        weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(in_features))
        weight = weight.to(FLOAT_DTYPES[form])
        if form == WeightForm.F16:
            edges = torch.tensor([*range(1024), *range(0x8000, 0x8400), 0x7BFF, 0xFBFF], dtype=torch.int32)
            flat = weight.view(-1)
            picks = edges[torch.arange(flat[::5].numel()) % len(edges)].to(torch.int16).view(torch.float16)
            flat[::5] = picks
        return weight
    return random_blocks(form, out_features, in_features)
