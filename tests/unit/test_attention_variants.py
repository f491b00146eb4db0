"""The attention variants (a sliding window, soft-capped scores, sinks, image blocks that attend both ways) on
every attention backend, through the metadata each builds from a step's segments, against a float64 softmax:
torch's SDPA path, the batch-invariant CPU kernel (also bit for bit the same for a request alone as in the
batch), and the GPU's Triton kernels (in Triton's interpreter where there is no GPU)."""

import importlib.util
from array import array
from types import SimpleNamespace

import pytest
import torch

from engine.kernels.cpu.native import load_library
from engine.model.attention.invariant import InvariantMetadata
from engine.model.attention.paged import image_key_ends, paged_attention
from engine.model.attention.torch_sdpa import TorchMetadata
from engine.model.attention.triton_paged import GpuAttention, TritonMetadata
from tests.conftest import CACHE_DIR

BLOCK_SIZE = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
NUM_BLOCKS = 24
SCALE = HEAD_DIM**-0.5
# (tokens cached before, tokens computed this step) per request: two decodes, a chunk after cached
# tokens whose window starts blocks in, a prompt from position 0 longer than the window.
SHAPES = [(40, 1), (5, 1), (30, 20), (0, 23)]
WINDOW = 7
SOFTCAP = 1.5
VARIANTS = {
    "window": dict(window=WINDOW),
    "softcap": dict(softcap=SOFTCAP),
    "sinks": dict(sinks=True),
    "all": dict(window=WINDOW, softcap=SOFTCAP, sinks=True),
}


# Image blocks [start, end) of each request of SHAPES whose tokens attend to each other both ways (Gemma 3's
# images): one inside the chunk after cached tokens, wider than the window; one in the prompt from 0, and one
# that ended before the chunk (it reads causally now). A chunk never ends inside a block.
IMAGE_BLOCKS = [(), (), ((10, 20), (33, 45)), ((2, 18),)]


def _step(generator, image_blocks=False):
    """Segments of SHAPES over blocks scattered through the cache, and the step's tensors."""
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    segments, slots, positions, rows = [], [], [], array("q")
    for row, (cached, num_new) in enumerate(SHAPES):
        end = cached + num_new
        table = [free.pop() for _ in range(-(-end // BLOCK_SIZE))]
        request = SimpleNamespace(block_table=table, image_blocks=IMAGE_BLOCKS[row] if image_blocks else ())
        segments.append(SimpleNamespace(request=request, start=cached, token_ids=[0] * num_new))
        for p in range(cached, end):
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            positions.append(p)
            rows.append(row)
    return segments, torch.tensor(slots), torch.tensor(positions), rows


def _reference(q, k_cache, v_cache, segments, window=0, softcap=0.0, sinks=None):
    """Each query over its request's keys in float64: scores, capped, masked to the window (and past itself to
    the end of its image block), softmax with the sink as one more logit."""
    out = []
    for segment in segments:
        table = segment.request.block_table
        for p in range(segment.start, segment.start + len(segment.token_ids)):
            first = max(0, p - window + 1) if window else 0
            end = max([p + 1] + [e for s, e in getattr(segment.request, "image_blocks", ()) if s <= p < e])
            slots = torch.tensor([table[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(first, end)])
            k = k_cache[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
            v = v_cache[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
            token = q[len(out)].double()
            scores = torch.einsum("hd,jhd->hj", token, k) * SCALE
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat((scores, sinks.double().cpu().unsqueeze(1)), dim=1)
            weights = torch.softmax(scores, dim=1)[:, : len(slots)]
            out.append(torch.einsum("hj,jhd->hd", weights, v))
    return torch.stack(out).float()


def _triton_metadata(segments, slot_mapping, positions, rows, key_ends=None):
    from engine.kernels.gpu import paged_decode, paged_prefill

    kernels = GpuAttention(
        paged_decode.paged_decode_attention,
        paged_prefill.paged_prefill_attention,
        paged_prefill.queries_per_tile(HEADS // KV_HEADS),
    )
    return TritonMetadata.build(kernels, segments, slot_mapping, BLOCK_SIZE, key_ends)


def _invariant_metadata(segments, slot_mapping, positions, rows, key_ends=None):
    library = load_library(CACHE_DIR)
    return InvariantMetadata.build(library, segments, slot_mapping, positions, rows, BLOCK_SIZE, key_ends)


def _torch_metadata(segments, slot_mapping, positions, rows, key_ends=None):
    return TorchMetadata.build(segments, slot_mapping, BLOCK_SIZE, key_ends)


BACKENDS = [
    pytest.param(_torch_metadata, id="torch"),
    pytest.param(_invariant_metadata, id="invariant"),
    pytest.param(
        _triton_metadata,
        id="triton",
        marks=[
            pytest.mark.interpreter,
            pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the GPU kernels are Triton's"),
        ],
    ),
]


def _device(metadata):
    """Where a backend's tensors live: the GPU's kernels on CUDA where there is one (else in the interpreter)."""
    return "cuda" if metadata is _triton_metadata and torch.cuda.is_available() else "cpu"


def _inputs(seed, image_blocks=False):
    generator = torch.Generator().manual_seed(seed)
    segments, slot_mapping, positions, rows = _step(generator, image_blocks)
    num_tokens = len(positions)
    # Scores of a few units, so the cap of 1.5 bites.
    q = 3 * torch.randn(num_tokens, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=generator)
    cache = [torch.randn(NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2)]
    sinks = torch.randn(HEADS, generator=generator)
    return segments, slot_mapping, positions, rows, q, k, v, cache, sinks


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("metadata", BACKENDS)
def test_each_variant_matches_a_float64_softmax(metadata, variant):
    segments, slot_mapping, positions, rows, q, k, v, (k_cache, v_cache), sinks = _inputs(seed=len(variant))
    device = _device(metadata)
    options = {**variant, "sinks": sinks.to(device) if variant.get("sinks") else None}
    q, k, v, k_cache, v_cache, slot_mapping = (t.to(device) for t in (q, k, v, k_cache, v_cache, slot_mapping))
    meta = metadata(segments, slot_mapping, positions, rows)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, **options)
    # The keys and values of the step are in the cache now, where the reference reads them.
    expected = _reference(*(t.cpu() for t in (q, k_cache, v_cache)), segments, **options)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_the_cpu_kernel_gives_a_request_the_same_bits_alone_as_in_the_batch(variant):
    segments, slot_mapping, positions, rows, q, k, v, (k_cache, v_cache), sinks = _inputs(seed=7)
    options = {**variant, "sinks": sinks if variant.get("sinks") else None}
    together = paged_attention(
        q, k, v, k_cache, v_cache, _invariant_metadata(segments, slot_mapping, positions, rows), SCALE, **options
    )
    first = 0
    for segment in segments:
        tokens = slice(first, first + len(segment.token_ids))
        alone = _invariant_metadata(
            [segment], slot_mapping[tokens], positions[tokens], array("q", [0] * len(segment.token_ids))
        )
        out = paged_attention(q[tokens], k[tokens], v[tokens], k_cache, v_cache, alone, SCALE, **options)
        assert torch.equal(out, together[tokens]), segment.start
        first = tokens.stop


def test_the_variants_off_are_plain_causal_attention():
    """The defaults change nothing: the same bits as passing each variant off explicitly, and a window
    longer than every context is no window."""
    segments, slot_mapping, positions, rows, q, k, v, (k_cache, v_cache), _ = _inputs(seed=3)
    for metadata in (_torch_metadata, _invariant_metadata):
        meta = metadata(segments, slot_mapping, positions, rows)
        plain = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE)
        torch.testing.assert_close(plain, _reference(q, k_cache, v_cache, segments), rtol=1e-5, atol=1e-5)
        wide = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, window=1000)
        torch.testing.assert_close(wide, plain, rtol=1e-6, atol=1e-6)


def _key_ends(segments, positions):
    ends = image_key_ends(segments, array("q", positions.tolist()))
    assert ends is not None
    return torch.tensor(ends)


@pytest.mark.parametrize("variant", [{}, dict(window=WINDOW), VARIANTS["all"]], ids=["plain", "window", "all"])
@pytest.mark.parametrize("metadata", BACKENDS)
def test_image_blocks_attend_both_ways_on_every_backend(metadata, variant):
    """A token of an image block reads every key of its block, past itself (a window still starts from its
    own position); other tokens, and blocks computed before the chunk, read causally."""
    segments, slot_mapping, positions, rows, q, k, v, (k_cache, v_cache), sinks = _inputs(seed=5, image_blocks=True)
    device = _device(metadata)
    options = {**variant, "sinks": sinks.to(device) if variant.get("sinks") else None}
    key_ends = _key_ends(segments, positions).to(device)
    q, k, v, k_cache, v_cache, slot_mapping = (t.to(device) for t in (q, k, v, k_cache, v_cache, slot_mapping))
    meta = metadata(segments, slot_mapping, positions, rows, key_ends)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, SCALE, **options).cpu()
    q, k_cache, v_cache = (t.cpu() for t in (q, k_cache, v_cache))
    expected = _reference(q, k_cache, v_cache, segments, **options)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    text = [
        SimpleNamespace(**{**vars(s), "request": SimpleNamespace(block_table=s.request.block_table)}) for s in segments
    ]
    assert not torch.allclose(out, _reference(q, k_cache, v_cache, text, **options), atol=1e-3)


def test_the_cpu_kernel_gives_an_image_block_the_same_bits_alone_as_in_the_batch():
    segments, slot_mapping, positions, rows, q, k, v, (k_cache, v_cache), sinks = _inputs(seed=9, image_blocks=True)
    together = paged_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        _invariant_metadata(segments, slot_mapping, positions, rows, _key_ends(segments, positions)),
        SCALE,
        window=WINDOW,
    )
    first = 0
    for segment in segments:
        tokens = slice(first, first + len(segment.token_ids))
        ends = image_key_ends([segment], array("q", positions[tokens].tolist()))
        alone = _invariant_metadata(
            [segment],
            slot_mapping[tokens],
            positions[tokens],
            array("q", [0] * len(segment.token_ids)),
            None if ends is None else torch.tensor(ends),
        )
        out = paged_attention(q[tokens], k[tokens], v[tokens], k_cache, v_cache, alone, SCALE, window=WINDOW)
        assert torch.equal(out, together[tokens]), segment.start
        first = tokens.stop


@pytest.mark.parametrize("variant", [{}, VARIANTS["all"]], ids=["plain", "all"])
@pytest.mark.parametrize("metadata", BACKENDS[1:])
def test_a_token_gets_the_same_bits_as_a_decode_as_at_the_end_of_a_chunk(metadata, variant):
    """A prompt's last token is the end of a prefill chunk alone, but a decode where the scheduler split the
    prompt so that it comes last in a step by itself: the batch-invariant backends give it the same bits both
    ways (on the GPU, two kernels)."""
    segments, slot_mapping, positions, rows, q, k, v, (k_cache, v_cache), sinks = _inputs(seed=13)
    device = _device(metadata)
    options = {**variant, "sinks": sinks.to(device) if variant.get("sinks") else None}
    q, k, v, k_cache, v_cache, slot_mapping = (t.to(device) for t in (q, k, v, k_cache, v_cache, slot_mapping))
    chunked = paged_attention(
        q, k, v, k_cache, v_cache, metadata(segments, slot_mapping, positions, rows), SCALE, **options
    )
    last = -1
    for segment in segments:
        last += len(segment.token_ids)
        if len(segment.token_ids) == 1:
            continue
        decode = SimpleNamespace(request=segment.request, start=positions[last].item(), token_ids=[0])
        token = slice(last, last + 1)
        meta = metadata([decode], slot_mapping[token], positions[token], array("q", [0]))
        alone = paged_attention(q[token], k[token], v[token], k_cache, v_cache, meta, SCALE, **options)
        assert torch.equal(alone, chunked[token]), segment.start
