"""Vision-language families on tiny random models with processors built here: Hugging Face's own greedy
`generate` with the same images, token for token, through chunked prefill that splits images (or, where an
image's tokens attend to each other both ways, keeps each whole); an image's embeddings depend on the image
alone (alone == in a batch == chunked == from the encoder cache and the prefix cache, one that ends inside an
image too); the prefix cache tells images apart; the tower runs once per distinct image."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from engine.channel import StreamChannel
from engine.model.families import SUPPORTED_VISION_MODEL_TYPES
from engine.model.loader import load_model
from engine.tiny import tiny_engine
from engine.tiny_vision import VISION_MODEL_TYPES, tiny_vision_folder
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR

NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


def picture(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


# (text before, images, text after): one image, another image with the same text, two images.
CONVERSATIONS = [
    ("Look: ", [picture(0)], "What is this?"),
    ("Look: ", [picture(1)], "What is this?"),
    ("Compare", [picture(2), picture(0)], "Which one is brighter, and why?"),
]


def prompt_text(processor, before: str, images: list, after: str) -> str:
    content = [{"type": "text", "text": before}, *({"type": "image"} for _ in images), {"type": "text", "text": after}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def test_every_supported_vision_model_type_is_tested_here():
    assert set(VISION_MODEL_TYPES) == SUPPORTED_VISION_MODEL_TYPES


@pytest.fixture(scope="module", params=VISION_MODEL_TYPES)
def folder(request, default_tokenizer, tmp_path_factory):
    return tiny_vision_folder(request.param, default_tokenizer, tmp_path_factory.mktemp(request.param))


def prompts(loaded) -> list[tuple[list[int], tuple]]:
    processor = loaded.processor
    return [loaded.model.vision.prompt(processor, prompt_text(processor, *c), c[1]) for c in CONVERSATIONS]


def hf_reference(folder, loaded) -> list[list[tuple[int, float]]]:
    """Hugging Face's greedy tokens and their logprobs, each conversation through the processor alone."""
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    expected = []
    for before, images, after in CONVERSATIONS:
        inputs = loaded.processor(
            text=[prompt_text(loaded.processor, before, images, after)], images=images, return_tensors="pt"
        )
        out = model.generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
        expected.append(list(zip(tokens, logprobs)))
    return expected


def small_budget(loaded, tokens: int) -> int:
    """A step's budget of `tokens`, or just past the longest image block where a step must hold one whole."""
    block = loaded.model.vision.longest_image_block
    return block + 3 if block else tokens


async def generate(engine, prompt, images, params=GREEDY):
    channel = StreamChannel(asyncio.get_running_loop(), num_choices=params.n)
    engine.submit("v", prompt, params, channel, images)
    chunks = [chunk async for chunk in channel]
    by_choice: dict[int, list] = {}
    for chunk in chunks:
        logprobs = [lp.logprob for lp in chunk.logprobs] or [None] * len(chunk.token_ids)
        by_choice.setdefault(chunk.index, []).extend(zip(chunk.token_ids, logprobs))
    return [by_choice[i] for i in sorted(by_choice)]


async def run(loaded, items, **config):
    engine = tiny_engine(loaded, **config)
    engine.start()
    try:
        return [r[0] for r in await asyncio.gather(*(generate(engine, p, i) for p, i in items))]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kernels", [True, False], ids=["invariant-kernels", "torch-kernels"])
async def test_greedy_matches_hf_generate_with_images_split_across_chunks(folder, kernels):
    loaded = load_model(str(folder), CACHE_DIR, "cpu", "float32", batch_invariant=kernels)
    assert loaded.model.batch_invariant == kernels
    items = prompts(loaded)
    expected = hf_reference(folder, loaded)
    # The image's tokens change the answer, so a forward that left them as text would fail here.
    assert expected[0] != expected[1]
    # A budget of 7 tokens (3 past an image that attends to itself both ways, which a step computes whole)
    # and blocks of 4: every image is split across steps, or starts a chunk, beside other requests' decodes.
    results = await run(loaded, items, max_num_batched_tokens=small_budget(loaded, 7), block_size=4)
    assert [[t for t, _ in r] for r in results] == [[t for t, _ in e] for e in expected]
    assert [[lp for _, lp in r] for r in results] == [pytest.approx([lp for _, lp in e], abs=1e-4) for e in expected]


async def test_outputs_depend_on_the_request_and_its_images_alone(folder):
    loaded = load_model(str(folder), CACHE_DIR, "cpu", "float32", batch_invariant=True)
    items = prompts(loaded)
    alone = [(await run(loaded, [item]))[0] for item in items]
    assert all(len(output) == NEW_TOKENS for output in alone)
    assert await run(loaded, items) == alone
    assert await run(loaded, items, max_num_batched_tokens=small_budget(loaded, 5)) == alone
    engine = tiny_engine(loaded)
    engine.start()
    try:
        embedder = engine.runner.images
        together = await asyncio.gather(*(generate(engine, p, i) for p, i in items))
        assert [t[0] for t in together] == alone
        assert embedder.num_encoded == 3  # picture(0) is in two conversations: encoded once
        hits = engine.block_manager.num_prefix_hits
        # Again, in reverse order: every image from the encoder cache, the prompts from the prefix cache.
        again = await asyncio.gather(*(generate(engine, p, i) for p, i in items[::-1]))
        assert [a[0] for a in again] == alone[::-1]
        assert embedder.num_encoded == 3
        assert engine.block_manager.num_prefix_hits > hits
    finally:
        engine.shutdown()


async def test_the_prefix_cache_tells_images_apart(folder):
    """The same text with another image finds only the blocks before that image; the same image finds them all."""
    loaded = load_model(str(folder), CACHE_DIR, "cpu", "float32", batch_invariant=True)
    (first, first_images), (other, other_images), _ = prompts(loaded)
    assert first == other  # the same token ids: only the image differs
    image_start = first_images[0].start
    engine = tiny_engine(loaded, block_size=4)
    engine.start()
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        await generate(engine, first, first_images, params)
        cached = []
        for images in (other_images, first_images):
            before = engine.block_manager.num_prefix_hits
            await generate(engine, first, images, params)
            cached.append(engine.block_manager.num_prefix_hits - before)
    finally:
        engine.shutdown()
    assert cached[0] == image_start // 4 * 4
    assert cached[1] == (len(first) - 1) // 4 * 4


async def test_a_prefix_hit_that_ends_inside_an_image_gives_the_uncached_answer(folder):
    """The same text and image, then other text: the cached blocks end inside the image, and the request computes
    the rest of it (seeing the cached part, which saw all of the image where its tokens attend both ways)."""
    loaded = load_model(str(folder), CACHE_DIR, "cpu", "float32", batch_invariant=True)
    processor, image, vision = loaded.processor, picture(0), loaded.model.vision
    first, first_images = vision.prompt(processor, prompt_text(processor, "Look: ", [image], "Hi"), [image])
    second, images = vision.prompt(processor, prompt_text(processor, "Look: ", [image], "Describe it"), [image])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    block_size, hit = next(
        (size, shared // size * size) for size in (16, 8, 4) if images[0].start < shared // size * size < images[0].end
    )
    alone = (await run(loaded, [(second, images)], block_size=block_size))[0]
    engine = tiny_engine(loaded, block_size=block_size)
    engine.start()
    try:
        await generate(engine, first, first_images, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        before = engine.block_manager.num_prefix_hits
        after_hit = (await generate(engine, second, images))[0]
        assert engine.block_manager.num_prefix_hits - before == hit
    finally:
        engine.shutdown()
    assert after_hit == alone


async def test_n_choices_share_one_encoding(folder):
    loaded = load_model(str(folder), CACHE_DIR, "cpu", "float32", batch_invariant=True)
    prompt, images = prompts(loaded)[0]
    engine = tiny_engine(loaded)
    engine.start()
    try:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
        choices = await generate(engine, prompt, images, params)
        assert engine.runner.images.num_encoded == 1
    finally:
        engine.shutdown()
    assert len(choices) == 3 and len({tuple(t for t, _ in c) for c in choices}) > 1


def test_the_encoder_cache_counts_one_query_per_request_starting_an_image():
    from engine.encoder_cache import EncoderCache

    cache = EncoderCache(max_rows=8)
    assert cache.get(1, num_queries=2) is None  # two requests start one new image: one encoding serves both
    cache.put(1, torch.zeros(5, 2))
    assert cache.get(1, num_queries=0) is not None  # a later chunk of it
    cache.put(2, torch.zeros(5, 2))  # past 8 rows: the least recently used goes
    assert cache.get(1) is None and cache.get(2) is not None
    assert (cache.num_queries, cache.num_hits, cache.num_rows) == (4, 2, 5)
