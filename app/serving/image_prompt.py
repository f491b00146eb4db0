"""A prompt's images: found in its messages, checked against the server's limits and the model, read and
decoded off the event loop, then through the model's processor with the rendered prompt (the processor
expands each image's placeholder into its image tokens and makes the tower's inputs)."""

from __future__ import annotations

import asyncio

import httpx
from PIL import Image
from starlette.concurrency import run_in_threadpool

from app.errors import OpenAIError
from app.serving.images import ImagePart, MediaPolicy, decode_image, image_bytes
from app.serving.messages import ChatMessage
from engine.images import ImageInput
from engine.model.loader import LoadedModel, ServedModel


def image_parts(messages: list[ChatMessage], name: str = "messages") -> list[ImagePart]:
    """Every image part of `messages`, in order, named as the request names it (messages[2].content[1].image_url)."""
    return [
        ImagePart(url, f"{name}[{i}].content[{j}].image_url")
        for i, message in enumerate(messages)
        for j, url in message.image_urls()
    ]


async def load_images(
    parts: list[ImagePart], policy: MediaPolicy, client: httpx.AsyncClient, loaded: ServedModel
) -> list[Image.Image]:
    """The parts' images, decoded, in order; a 400 naming the first part at fault."""
    if not parts:
        return []
    if loaded.processor is None:
        raise OpenAIError(
            400,
            f"{parts[0].param}: the model {loaded.name} takes text only, not images",
            param=parts[0].param,
            code="image_input_not_supported",
        )
    if len(parts) > policy.max_images:
        over = parts[policy.max_images]
        raise OpenAIError(
            400,
            f"{over.param}: at most {policy.max_images} images per request (--limit-images-per-prompt)",
            param=over.param,
            code="too_many_images",
        )
    read = await asyncio.gather(*(image_bytes(part, policy, client) for part in parts), return_exceptions=True)
    for outcome in read:
        if isinstance(outcome, BaseException):
            raise outcome
    return [await run_in_threadpool(decode_image, part, data, policy) for part, data in zip(parts, read)]


async def vision_prompt(
    loaded: ServedModel, text: str, images: list[Image.Image], param: str
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """The rendered prompt `text` with its `images` through the model's processor: token ids and images."""
    # A processor comes with the model's weights (a cluster's ingress has neither).
    assert isinstance(loaded, LoadedModel) and loaded.processor is not None
    vision = loaded.model.vision
    assert vision is not None
    try:
        return await run_in_threadpool(vision.prompt, loaded.processor, text, images)
    except ValueError as exc:
        # The processor counts placeholders against images (a text that writes an image token of its own).
        raise OpenAIError(400, f"the model's processor refused the prompt's images: {exc}", param=param) from exc
