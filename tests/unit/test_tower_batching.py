"""The vision tower batched across a step's images: each image's embeddings are those it has encoded alone, bit
for bit, in every family; a step whose requests bring new images encodes them in one tower call, and each
request's tokens and logprobs are those it has alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.channel import StreamChannel
from engine.model.invariant_tower import KernelLinear, PatchLinear
from engine.model.loader import load_model
from engine.tiny import tiny_engine
from engine.tiny_vision import VISION_MODEL_TYPES, tiny_vision_folder
from tests.conftest import CACHE_DIR
from tests.unit.test_vision import GREEDY, generate, picture, prompt_text

# Three images of different content and shape (Qwen-VL keeps each at its own resolution: three grids).
IMAGES = [picture(10, (40, 30)), picture(11, (60, 50)), picture(12, (30, 90))]


@pytest.fixture(scope="module", params=VISION_MODEL_TYPES)
def loaded(request, default_tokenizer, tmp_path_factory):
    folder = tiny_vision_folder(request.param, default_tokenizer, tmp_path_factory.mktemp(request.param))
    return load_model(str(folder), CACHE_DIR, "cpu", "float32", batch_invariant=True)


def prompts(loaded, images) -> list[tuple[list[int], tuple]]:
    processor, vision = loaded.processor, loaded.model.vision
    return [vision.prompt(processor, prompt_text(processor, "Look: ", [i], "What is it?"), [i]) for i in images]


def test_the_tower_mixes_images_rows_only_on_the_invariant_kernels(loaded):
    vision = loaded.model.vision
    language = set(vision.language().model.modules())
    tower = [m for m in vision.hf_model.model.modules() if m not in language]
    assert any(isinstance(m, KernelLinear) for m in tower) and any(isinstance(m, PatchLinear) for m in tower)
    mixing = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)
    outside = [m for m in tower if isinstance(m, mixing) and not any(m in set(p.modules()) for p in _heads(tower))]
    assert outside == []


def _heads(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """torch's MultiheadAttention modules (SigLIP's pooling head, whose output no family's embeddings take)."""
    return [m for m in modules if isinstance(m, torch.nn.MultiheadAttention)]


def test_images_encoded_together_are_each_alone_bit_for_bit(loaded):
    vision = loaded.model.vision
    images = [image for _, (image,) in prompts(loaded, IMAGES)]
    # One call: every image's inputs stack (the test would compare nothing batched otherwise).
    assert len({vision.batch_key(image.inputs) for image in images}) == 1
    alone = [vision.encode(image.inputs) for image in images]
    assert len({a.shape[0] for a in alone}) > 1 or not vision.rope_by_grid  # Qwen-VL: three sizes
    assert len({a.sum().item() for a in alone}) == 3
    together = vision.encode_batch([image.inputs for image in images], [image.num_rows for image in images])
    for one, batched in zip(alone, together):
        assert torch.equal(one, batched)
    # In another order and beside a copy of itself, too.
    reordered = vision.encode_batch([images[i].inputs for i in (2, 0, 2)], [images[i].num_rows for i in (2, 0, 2)])
    assert all(torch.equal(alone[i], batched) for i, batched in zip((2, 0, 2), reordered))


async def test_a_step_encodes_its_requests_new_images_in_one_tower_call(loaded):
    items = prompts(loaded, IMAGES)
    alone = []
    for prompt, images in items:
        engine = tiny_engine(loaded)
        engine.start()
        try:
            alone.append((await generate(engine, prompt, images))[0])
        finally:
            engine.shutdown()
    # A step's budget that holds the three prompts whole.
    engine = tiny_engine(loaded, max_num_batched_tokens=512)
    loop = asyncio.get_running_loop()
    channels = [StreamChannel(loop, num_choices=1) for _ in items]
    # Submitted before the engine runs: its first step admits all three.
    for i, ((prompt, images), channel) in enumerate(zip(items, channels)):
        engine.submit(f"r{i}", prompt, GREEDY, channel, images)
    engine.start()
    try:
        outputs = []
        for channel in channels:
            chunks = [chunk async for chunk in channel]
            outputs.append([(t, lp.logprob) for c in chunks for t, lp in zip(c.token_ids, c.logprobs)])
        embedder = engine.runner.images
        assert (embedder.num_encoded, embedder.num_calls) == (3, 1)
        # The step's encoder budget reads the cache the tower fills (engine/encoder_budget.py).
        assert engine.scheduler.encoder_cache is embedder.cache
    finally:
        engine.shutdown()
    assert outputs == alone


# On torch's kernels: --no-batch-invariant, and the invariant kernels declining a CPU model that is not float32.
@pytest.mark.parametrize(("batch_invariant", "dtype"), [(False, "float32"), (True, "bfloat16")])
async def test_on_torchs_kernels_each_new_image_is_its_own_tower_call(
    batch_invariant, dtype, default_tokenizer, tmp_path
):
    """torch's kernels pick their blocking by the row count, so images stacked would change each other's bits
    (and the encoder cache's): the tower encodes each alone."""
    folder = tiny_vision_folder("qwen2_vl", default_tokenizer, tmp_path)
    loaded = load_model(str(folder), CACHE_DIR, "cpu", dtype, batch_invariant=batch_invariant)
    assert not loaded.model.vision.invariant_tower
    engine = tiny_engine(loaded, max_num_batched_tokens=512)
    loop = asyncio.get_running_loop()
    channels = [StreamChannel(loop, num_choices=1) for _ in IMAGES]
    for i, ((prompt, images), channel) in enumerate(zip(prompts(loaded, IMAGES), channels)):
        engine.submit(f"r{i}", prompt, GREEDY, channel, images)
    engine.start()
    try:
        for channel in channels:
            assert [chunk async for chunk in channel][-1].finish_reason == "length"
        embedder = engine.runner.images
        assert (embedder.num_encoded, embedder.num_calls) == (3, 3)
    finally:
        engine.shutdown()


def test_the_encoder_cache_holds_a_steps_encoder_budget(loaded):
    """A step may start as many new images' rows as its token budget, past the cache's own size: the cache holds
    them all, or the step's later images would drop its earlier ones (which chunked images then encode again)."""
    engine = tiny_engine(loaded, max_num_batched_tokens=1 << 15)
    assert engine.scheduler.max_num_encoder_input_tokens == 1 << 15
    assert engine.runner.images.cache.max_rows >= 1 << 15


def test_idefics3_images_with_a_padded_tile_never_share_a_call_with_unpadded_ones(default_tokenizer, tmp_path):
    """transformers drops the tower's attention mask only where the whole call's pixel_attention_mask is all true,
    which picks the attention kernel every image of the call runs on."""
    folder = tiny_vision_folder("idefics3", default_tokenizer, tmp_path)
    loaded = load_model(str(folder), CACHE_DIR, "cpu", "float32", batch_invariant=True)
    vision = loaded.model.vision
    plain, other = (image.inputs for _, (image,) in prompts(loaded, IMAGES[:2]))
    assert bool(plain["pixel_attention_mask"].all()) and bool(other["pixel_attention_mask"].all())
    assert vision.batch_key(plain) == vision.batch_key(other)
    mask = other["pixel_attention_mask"].clone()
    mask[:, -1, :, mask.shape[-1] // 2 :] = 0
    padded = {**other, "pixel_attention_mask": mask}
    assert vision.batch_key(padded) != vision.batch_key(plain)
