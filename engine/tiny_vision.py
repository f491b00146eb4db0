"""Tiny random vision-language models with processors built here (no downloads): the default model's tokenizer
with the family's image tokens added, a small image processor and a chat template that writes image
placeholders; for unit tests, and as folders a server loads."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)

# ChatML with each image part as the family's placeholder, text parts as they are.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}PLACEHOLDER{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.2,
)
# A 28-pixel image in 7-pixel patches: 16 patches, and the CLIP tower's class row.
_CLIP = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=28,
    patch_size=7,
    projection_dim=32,
)

VISION_MODEL_TYPES = ("gemma3", "idefics3", "llava", "qwen2_5_vl", "qwen2_vl")


def _llava(tokenizer: PreTrainedTokenizerBase) -> tuple[dict, ProcessorMixin]:
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    image_token = "<image>"
    tokenizer.add_special_tokens({"additional_special_tokens": [image_token]})
    config = dict(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), **_TEXT),
        vision_config=_CLIP,
        image_token_index=tokenizer.convert_tokens_to_ids(image_token),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tokenizer,
        patch_size=7,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=TEMPLATE.replace("PLACEHOLDER", image_token),
    )
    return config, processor


def _idefics3(tokenizer: PreTrainedTokenizerBase) -> tuple[dict, ProcessorMixin]:
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    # Tiles of 28 pixels, images resized to at most 56: a 40x30 image is 2x2 tiles and the whole image, each
    # 16 patches shuffled by 2 into 4 image tokens.
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28}),
        tokenizer=tokenizer,
        image_seq_len=4,
        chat_template=TEMPLATE.replace("PLACEHOLDER", "<image>"),
    )
    config = dict(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), **_TEXT),
        vision_config=dict(
            model_type="idefics3_vision",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=7,
        ),
        scale_factor=2,
        image_token_id=processor.image_token_id,
    )
    return config, processor


def _gemma3(tokenizer: PreTrainedTokenizerBase) -> tuple[dict, ProcessorMixin]:
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    # Gemma 3's processor reads its tokens by name off the tokenizer (boi_token, image_token, eoi_token).
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(
            folder,
            extra_special_tokens={
                "boi_token": "<start_of_image>",
                "image_token": "<image_soft_token>",
                "eoi_token": "<end_of_image>",
            },
        )
    # 56-pixel images in 7-pixel patches, 8 x 8 pooled by 2 into 16 image tokens: a run longer than the
    # sliding window of 12, so a window and an image's block both bite.
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
        tokenizer=tokenizer,
        image_seq_length=16,
        chat_template=TEMPLATE.replace("PLACEHOLDER", "<start_of_image>"),
    )
    config = dict(
        text_config=dict(
            model_type="gemma3_text",
            vocab_size=len(tokenizer),
            **{**_TEXT, "num_hidden_layers": 4},
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            sliding_window=12,
            query_pre_attn_scalar=24,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=56,
            patch_size=7,
        ),
        mm_tokens_per_image=16,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
        initializer_range=0.2,
    )
    return config, processor


def _qwen_vl(model_type: str, tokenizer: PreTrainedTokenizerBase) -> tuple[dict, ProcessorMixin]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from engine.model.families.qwen_vl import QwenVLProcessor

    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = TEMPLATE.replace("PLACEHOLDER", "<|vision_start|><|image_pad|><|vision_end|>")
    # Images resized to 28-pixel multiples between 56 x 56 and 112 x 112 pixels, in 14-pixel patches merged 2 x 2:
    # a 40 x 30 image is 56 x 84 pixels, 4 x 6 patches, 2 x 3 image tokens (its rows and columns rotate apart).
    processor = QwenVLProcessor(
        Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2),
        tokenizer,
        tokenizer.chat_template,
    )
    # M-RoPE: of the head's 8 frequencies, 2 rotate by time, 3 by row and 3 by column.
    tokens = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    text = dict(_TEXT, model_type=f"{model_type}_text", vocab_size=len(tokenizer), **tokens)
    text.pop("head_dim")
    text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    vision = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if model_type == "qwen2_5_vl":
        # Windows of 2 x 2 merged tokens in the first block, full attention in the second.
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56)
        vision.update(fullatt_block_indexes=[1])
    else:
        vision.update(embed_dim=32, mlp_ratio=2, hidden_size=64)
    ids = {
        name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(("start", "end", "image", "video"), special)
    }
    config = dict(
        text_config=text,
        vision_config=vision,
        vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"],
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        initializer_range=0.2,
        **tokens,
    )
    return config, processor


_BUILDERS = {
    "gemma3": _gemma3,
    "idefics3": _idefics3,
    "llava": _llava,
    "qwen2_5_vl": lambda tokenizer: _qwen_vl("qwen2_5_vl", tokenizer),
    "qwen2_vl": lambda tokenizer: _qwen_vl("qwen2_vl", tokenizer),
}

# Parameters Hugging Face initializes to zeros that would leave the images out of the answer (Gemma 3's
# projection): drawn at random here, as a trained model's are not zero.
_RANDOM_ZEROS = {"gemma3": ("model.multi_modal_projector.mm_input_projection_weight",)}


def tiny_vision_model(model_type: str, tokenizer: PreTrainedTokenizerBase, seed: int = 0):
    """A random vision-language model of `model_type` and its processor over a copy of `tokenizer`."""
    config_fields, processor = _BUILDERS[model_type](copy.deepcopy(tokenizer))
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **config_fields)
    model = AutoModelForImageTextToText.from_config(config).eval()
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name in _RANDOM_ZEROS.get(model_type, ()):
            parameters[name].normal_(std=config.initializer_range)
    return model, processor


def tiny_vision_folder(model_type: str, tokenizer: PreTrainedTokenizerBase, path: Path) -> Path:
    """tiny_vision_model saved as a model folder (weights, config, processor, tokenizer, template)."""
    model, processor = tiny_vision_model(model_type, tokenizer)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
