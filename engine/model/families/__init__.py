"""The model families Sluice serves, one file each, and the one place that maps a config's model_type
to its family. Adding a family: a file here over engine/model/layers.py, its entry in FAMILIES, and its
parity and invariance tests (docs/models.md). A vision-language model is a VisionFamily (its images) over
the DecoderFamily of its language model's model_type."""

from __future__ import annotations

from transformers import PreTrainedModel

from engine.model.families.base import DecoderFamily
from engine.model.families.gemma2 import Gemma2
from engine.model.families.gemma3 import Gemma3
from engine.model.families.gemma3_vision import Gemma3Vision
from engine.model.families.gpt_oss import GptOss
from engine.model.families.granite import Granite
from engine.model.families.idefics3 import Idefics3
from engine.model.families.llama import Llama
from engine.model.families.llava import Llava
from engine.model.families.mixtral import Mixtral
from engine.model.families.olmo2 import Olmo2
from engine.model.families.phi3 import Phi3
from engine.model.families.qwen_vl import QwenVL
from engine.model.families.smollm3 import SmolLM3
from engine.model.families.vision import LanguagePart, VisionFamily

FAMILIES: tuple[type[DecoderFamily], ...] = (Gemma2, Gemma3, GptOss, Granite, Llama, Mixtral, Olmo2, Phi3, SmolLM3)

VISION_FAMILIES: tuple[type[VisionFamily], ...] = (Gemma3Vision, Idefics3, Llava, QwenVL)

_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
_VISION_BY_MODEL_TYPE = {model_type: family for family in VISION_FAMILIES for model_type in family.model_types}

SUPPORTED_MODEL_TYPES = frozenset(_BY_MODEL_TYPE)
SUPPORTED_VISION_MODEL_TYPES = frozenset(_VISION_BY_MODEL_TYPE)


class ModelFolderError(ValueError):
    """A model folder Sluice cannot serve; the message names the file and what it lacks, in one line."""


class UnsupportedModelError(ModelFolderError):
    pass


def family_for(model_type: str) -> type[DecoderFamily]:
    """The family that serves `model_type`."""
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        supported = sorted(SUPPORTED_MODEL_TYPES | SUPPORTED_VISION_MODEL_TYPES)
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: {', '.join(supported)}")
    return family


def vision_family_for(model_type: str) -> type[VisionFamily] | None:
    """The vision family that serves `model_type`, or None for a text model's type."""
    return _VISION_BY_MODEL_TYPE.get(model_type)


def vision_of(hf_model: PreTrainedModel) -> VisionFamily | None:
    """The images' side of `hf_model`, or None for a text model; a model with a vision tower of a type no
    vision family serves is refused."""
    model_type = hf_model.config.model_type
    vision = vision_family_for(model_type)
    if vision is None and hasattr(hf_model.config, "vision_config"):
        family_for(model_type)  # raises: a vision-language model of a type not served
    return vision(hf_model) if vision is not None else None


def family_of(hf_model: PreTrainedModel | LanguagePart) -> DecoderFamily:
    """The family that runs `hf_model` (or a vision-language model's LanguagePart), built over its modules."""
    return family_for(hf_model.config.model_type)(hf_model)


def decoder_of(vision: VisionFamily) -> DecoderFamily:
    """The family that runs a vision-language model's decoder: the vision family's own where it has one, else
    that of its text_config's model_type."""
    language = vision.language()
    return vision.decoder(language) if vision.decoder is not None else family_of(language)
