"""Model loading: a local Hugging Face folder, or the embedded default model converted once from GGUF."""

from __future__ import annotations

import ctypes
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    Mxfp4Config,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)

from engine.detokenizer import TokenBytes  # noqa: E402
from engine.kernels.cpu.native import load_library  # noqa: E402
from engine.model.causal_lm import PagedCausalLM  # noqa: E402
from engine.model.families import (  # noqa: E402
    ModelFolderError,
    vision_family_for,
)
from engine.model.families.qwen_vl import QwenVLProcessor  # noqa: E402
from engine.model.invariant_kernels import use_invariant_kernels  # noqa: E402
from engine.model.model_files import (  # noqa: E402
    default_model_gguf,
    gguf_file,
    model_folder,
    serves_text_part,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServedModel:
    """What the HTTP layer needs to know about the served model: its tokenizer and limits, not its weights
    (a cluster's ingress loads only this: load_served_model)."""

    tokenizer: PreTrainedTokenizerBase
    token_bytes: TokenBytes
    name: str
    path: Path
    eos_token_ids: frozenset[int]
    max_position_embeddings: int
    vocab_size: int
    # A vision-language model's processor (from the folder): images → tower inputs, placeholders → image
    # tokens. None for a text model, which takes no images (and in a cluster's ingress, for now).
    processor: ProcessorMixin | QwenVLProcessor | None = None


@dataclass(frozen=True, kw_only=True)
class LoadedModel(ServedModel):
    """The served model with its weights on the device: what an engine runs."""

    model: PagedCausalLM
    # Sluice's CPU kernels, for the sampler; None on a GPU or where they cannot run.
    cpu_kernels: ctypes.CDLL | None = None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, batch_invariant: bool = False) -> torch.dtype:
    """ "auto" is bfloat16 on CUDA. On a CPU it is float32 when batch-invariant (the invariant
    kernels are float32), else bfloat16 where the CPU has native bf16 (AVX512-BF16 or AMX)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16
    if batch_invariant:
        return torch.float32
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_model(
    model: str | None,
    cache_dir: Path,
    device: str,
    dtype: str,
    batch_invariant: bool = False,
    quantize: str | None = None,
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    """Load `model` (a local HF folder, or None for the embedded default) onto the device; `quantize`
    ("q8_0" or "q4_1") quantizes its linear layers for the batch-invariant kernels; `kv_cache_dtype` (a torch
    dtype's name, or "auto": the model's) is the KV cache's, other than the model's only on those kernels."""
    path, name = model_folder(model, cache_dir)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, batch_invariant)
    logger.info("loading %s from %s on %s as %s", name, path, torch_device, torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    vision_family = vision_family_for(config.model_type) if model is not None else None
    vision = vision_family is not None
    processor = vision_family.load_processor(path, tokenizer) if vision_family is not None else None
    if processor is not None and not tokenizer.chat_template:
        tokenizer.chat_template = processor.chat_template
    auto_model = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    extra = _dequantizing(path, name, torch_dtype)
    if model is not None and not vision and serves_text_part(config.to_dict()):
        logger.info(
            "%s: a %s checkpoint's language model (%s) is served, its images are not (its vision tower is not loaded)",
            name,
            config.model_type,
            config.text_config.model_type,
        )
        extra.update(config=config.text_config, key_mapping=_LANGUAGE_MODEL_KEYS)
    hf_model, loading = auto_model.from_pretrained(path, dtype=torch_dtype, output_loading_info=True, **extra)
    if loading["missing_keys"]:
        # transformers would fill them with random values and only log it.
        missing = sorted(loading["missing_keys"])
        raise ModelFolderError(
            f"{path}: the weights lack {len(missing)} tensor(s) the model needs, {', '.join(missing[:3])}"
            + (", ..." if len(missing) > 3 else "")
        )
    hf_model = hf_model.to(torch_device).eval()
    for parameter in hf_model.parameters():
        # Parameters only: buffers such as the rotary inv_freq keep their float32 precision.
        parameter.data = parameter.data.to(torch_dtype)
    paged = PagedCausalLM(hf_model)
    if quantize is not None and not batch_invariant:
        raise ValueError(f"--quantize {quantize} needs the batch-invariant kernels (leave out --no-batch-invariant)")
    if batch_invariant:
        use_invariant_kernels(
            paged, hf_model, cache_dir, default_model_gguf() if model is None else gguf_file(model), quantize=quantize
        )
        if quantize is not None and paged.kernels is None:
            raise ValueError(f"--quantize {quantize} needs the batch-invariant CPU kernels, which cannot run here")
    if kv_cache_dtype != "auto":
        paged.use_kv_dtype(getattr(torch, kv_cache_dtype))
    eos = _eos_token_ids(hf_model.generation_config.eos_token_id, tokenizer)
    return LoadedModel(
        model=paged,
        tokenizer=tokenizer,
        token_bytes=TokenBytes.from_tokenizer(tokenizer),
        name=name,
        path=path,
        eos_token_ids=eos,
        max_position_embeddings=paged.max_position_embeddings,
        vocab_size=paged.vocab_size,
        cpu_kernels=load_library(cache_dir) if torch_device.type == "cpu" else None,
        processor=processor,
    )


def _dequantizing(path: Path, name: str, dtype: torch.dtype) -> dict:
    """from_pretrained's arguments that widen a checkpoint's quantized weights as they load, for the
    quantizations Sluice reads: MXFP4 (gpt-oss's experts, 4-bit values in blocks of 32 with a power-of-two
    scale each). No kernel here reads MXFP4 itself, so its values are widened to `dtype`, which holds them
    exactly (the batch-invariant CPU kernels then keep them as bfloat16: 4 times their packed size)."""
    config = json.loads((path / "config.json").read_text())
    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "mxfp4":
        return {}
    logger.info(
        "%s: the experts' MXFP4 weights are widened to %s at load (no kernel here reads MXFP4 packed)",
        name,
        str(dtype).removeprefix("torch."),
    )
    # dequantize=True: without it transformers fetches Triton kernels from the Hub where it can, or
    # replaces the experts with modules the forward cannot run.
    return {"quantization_config": Mxfp4Config(dequantize=True)}


def load_served_model(model: str | None, cache_dir: Path) -> ServedModel:
    """The tokenizer and the limits of `model` (as load_model names and finds it), without its weights
    (the embedded default is converted first where no engine has converted it yet)."""
    path, name = model_folder(model, cache_dir)
    # A vision-language model's decoder's (its images are not served through a cluster yet).
    config = AutoConfig.from_pretrained(path).get_text_config()
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: transformers derives it from the config, as here
        generation = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return ServedModel(
        tokenizer=tokenizer,
        token_bytes=TokenBytes.from_tokenizer(tokenizer),
        name=name,
        path=path,
        eos_token_ids=_eos_token_ids(generation.eos_token_id, tokenizer),
        max_position_embeddings=config.max_position_embeddings,
        vocab_size=config.vocab_size,
    )


# Where a vision-language checkpoint keeps its language model's weights (transformers 4's layout, which 5 still
# writes, and 5's), and where a text model of its decoder's type has them.
_LANGUAGE_MODEL_KEYS = {
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
    r"^model\.language_model\.": "model.",
}


def _eos_token_ids(configured: int | list[int] | None, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = set(configured if isinstance(configured, list) else [configured])
    ids.add(tokenizer.eos_token_id)
    ids.discard(None)
    return frozenset(ids)
