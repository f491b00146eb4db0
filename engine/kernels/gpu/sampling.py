"""The sampler's GPU kernel, in Triton: one launch draws a token for every row of a step, on the device.

It does what the CPU kernel (sampling.cpp) does, one program per row: an argmax for a greedy row; for a
sampled row a max pass, one pass of weights exp((x - max) / temperature) summed per 256-token block,
and a two-level inverse-CDF draw (the block, then the token inside it) from the counter-based uniforms
of engine/sampling/draws.py, computed in the kernel. Top-k cuts at the k-th largest logit (one torch
`topk` before the launch, only when a row asks for it), min-p at a floor, and top-p by rejection with
no sort: a drawn token is kept when the mass heavier than it is below top_p, otherwise it and every
token as light go and the row draws again. A row still undecided after the rounds finds its nucleus's
floor by bisection over the float's bits, one pass per step, instead of the CPU kernel's sort. Weights
are recomputed from the logits at each pass, so no vocabulary-sized buffer is written.

No step of a row depends on another row, and every reduction runs in an order fixed by the kernel's
shape, so a seeded request draws the same tokens in any batch. The kernel and the other two paths draw
from the same distribution; their tokens for a seed agree except where float rounding of a sum differs.

With TRITON_INTERPRET=1 set before this module is imported it runs on CPU tensors too, which is how
the tests check it on machines without a GPU.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from engine.kernels.cpu.invariant import BLOCK
from engine.model.uploads import upload
from engine.sampling.draws import MAX_REJECTION_ROUNDS

# Cache blocks of the vocabulary one pass loads at a time.
_TILE_BLOCKS = 8
# Per row, as int64 words: row_settings' three (1 / temperature, top_p and min_p as float32, then
# top_k), the draw key and the position.
_WORDS = 5


def sample_on_device(
    logits: torch.Tensor, settings: bytes, keys: Sequence[int], positions: Sequence[int], top_k: int
) -> torch.Tensor:
    """One token per row of float32 `logits` [R, V] (on the device), row i drawn with the i-th of `settings`
    (engine/kernels/cpu/sampling.py's row_settings, joined), its draw key keys[i] at positions[i]; `top_k` is
    the largest top_k of any row (0: none asks for it). The tokens stay on the device."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    packed = torch.frombuffer(bytearray(settings), dtype=torch.int64)
    key_words = torch.frombuffer(array("Q", keys), dtype=torch.int64)
    host = torch.cat([packed.view(rows, 3), key_words.view(rows, 1), torch.tensor(positions).view(rows, 1)], dim=1)
    words = upload(host, logits.device)
    top_k = min(top_k, vocab)
    # The k-th largest logit of a top-k row is its value at column k - 1 (the kernel reads it there).
    largest = logits.topk(top_k, dim=-1).values if top_k > 0 else logits
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    _sample[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        words.view(torch.float32),
        words,
        largest,
        largest.stride(0),
        tokens,
        HAS_TOP_K=top_k > 0,
        NUM_BLOCKS=triton.next_power_of_2(triton.cdiv(vocab, BLOCK)),
        BLOCK=BLOCK,
        TILE_BLOCKS=_TILE_BLOCKS,
        MAX_ROUNDS=MAX_REJECTION_ROUNDS,
        WORDS=_WORDS,
    )
    return tokens


@triton.jit
def _mix(x):
    """splitmix64's finalizer, as draws._mix (uint64 arithmetic wraps as Python's masking does)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _uniform(key, position, lane):
    """draws.uniform(key, position, lane), bit for bit: key and position as uint64."""
    x = _mix(key + 0x9E3779B97F4A7C15 * (position + 1))
    x = _mix(x ^ ((lane.to(tl.uint64) + 1) * 0xD1B54A32D192ED03))
    return (x >> 11).to(tl.float64) * 1.1102230246251565e-16


@triton.jit
def _weight(x, top, scale):
    """exp((x - top) / temperature) as 2^((x - top) * scale), zero below 2^-125 (and for -inf or NaN).
    The max is subtracted before the scale multiplies, so the best token's weight is exactly 1."""
    t = (x - top) * scale
    w = tl.where(t == 0.0, 1.0, tl.exp2(t))
    return tl.where(t >= -125.0, w, 0.0)


@triton.jit
def _block_sums(
    row, vocab, top, scale, floor, NUM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, TILE_BLOCKS: tl.constexpr
):
    """Each block's float32 sum of the weights >= floor ([NUM_BLOCKS], 0 past the vocabulary), and the
    row's mass: their float64 sum."""
    blocks = tl.arange(0, NUM_BLOCKS)
    tile = tl.arange(0, TILE_BLOCKS)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    sums = tl.zeros([NUM_BLOCKS], tl.float32)
    for first in range(0, tl.cdiv(vocab, BLOCK), TILE_BLOCKS):
        columns = first * BLOCK + tile
        w = _weight(tl.load(row + columns, mask=columns < vocab, other=float("-inf")), top, scale)
        tile_sums = tl.sum(tl.where(w >= floor, w, 0.0), 1)
        # Into the row's vector: each block's sum lands on its own lane; the other terms add exact zeros.
        here = blocks[:, None] == first + tl.arange(0, TILE_BLOCKS)[None, :]
        sums += tl.sum(tl.where(here, tile_sums[None, :], 0.0), 1)
    return sums, tl.sum(sums.to(tl.float64), 0)


@triton.jit
def _draw(row, vocab, top, scale, floor, sums, u, NUM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr):
    """One token among the weights >= floor by inverse CDF at u, given their block sums: the block whose
    running mass passes u x total, then the token inside it; rounding past the end takes the last
    token with weight (token 0 where no token has any)."""
    blocks = tl.arange(0, NUM_BLOCKS)
    mass = sums.to(tl.float64)
    running = tl.cumsum(mass, 0)
    goal = u * tl.sum(mass, 0)
    weighty = mass > 0
    block = tl.min(tl.where(weighty & (running > goal), blocks, NUM_BLOCKS), 0)
    block = tl.where(block == NUM_BLOCKS, tl.max(tl.where(weighty, blocks, -1), 0), block)
    rest = goal - tl.sum(tl.where(blocks == block, running - mass, 0.0), 0)
    lanes = tl.arange(0, BLOCK)
    columns = block * BLOCK + lanes
    w = _weight(tl.load(row + columns, mask=(columns >= 0) & (columns < vocab), other=float("-inf")), top, scale)
    w = tl.where(w >= floor, w, 0.0)
    kept = w > 0
    inside = tl.cumsum(w.to(tl.float64), 0)
    pick = tl.min(tl.where(kept & (inside > rest), lanes, BLOCK), 0)
    pick = tl.where(pick == BLOCK, tl.max(tl.where(kept, lanes, -1), 0), pick)
    return tl.where(pick >= 0, block * BLOCK + pick, 0)


@triton.jit
def _above(w):
    """The next float32 after a non-negative finite w: the floor that drops w and everything as light."""
    return (w.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)


@triton.jit
def _nucleus_floor(
    row, vocab, top, scale, floor, target, NUM_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, TILE_BLOCKS: tl.constexpr
):
    """The lightest weight in the nucleus of the weights >= floor: the least f such that the mass above
    f is below `target` (or nothing is), found by bisection over the bits of a positive float32, which
    order as the floats do. Every token as heavy as f is then in, and every lighter one out."""
    outside = floor.to(tl.int32, bitcast=True) - 1
    inside = tl.full([], 1.0, tl.float32).to(tl.int32, bitcast=True)
    while inside - outside > 1:
        middle = outside + (inside - outside) // 2
        _, heavier = _block_sums(
            row, vocab, top, scale, _above(middle.to(tl.float32, bitcast=True)), NUM_BLOCKS, BLOCK, TILE_BLOCKS
        )
        if (heavier < target) | (heavier <= 0):
            inside = middle
        else:
            outside = middle
    return inside.to(tl.float32, bitcast=True)


@triton.jit
def _sample(
    logits_ptr,
    row_stride,
    vocab,
    floats_ptr,
    words_ptr,
    largest_ptr,
    largest_stride,
    tokens_ptr,
    HAS_TOP_K: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    MAX_ROUNDS: tl.constexpr,
    WORDS: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = logits_ptr + r * row_stride
    inverse_t = tl.load(floats_ptr + r * 2 * WORDS)
    top_p = tl.load(floats_ptr + r * 2 * WORDS + 1)
    min_p = tl.load(floats_ptr + r * 2 * WORDS + 2)
    top_k = tl.load(words_ptr + r * WORDS + 2)
    key = tl.load(words_ptr + r * WORDS + 3).to(tl.uint64, bitcast=True)
    position = tl.load(words_ptr + r * WORDS + 4).to(tl.uint64)

    # The max, and where it first is (a greedy row's token, ties to the lowest id as torch's argmax).
    offsets = tl.arange(0, TILE_BLOCKS * BLOCK)
    top = tl.full([], float("-inf"), tl.float32)
    token = tl.full([], 0, tl.int64)
    for start in range(0, vocab, TILE_BLOCKS * BLOCK):
        x = tl.load(row + start + offsets, mask=start + offsets < vocab, other=float("-inf"))
        tile_max = tl.max(x, 0)
        better = tile_max > top
        token = tl.where(better, start + tl.argmax(x, 0).to(tl.int64), token)
        top = tl.where(better, tile_max, top)

    if (inverse_t > 0.0) & (top > float("-inf")):
        scale = (inverse_t.to(tl.float64) * 1.4426950408889634).to(tl.float32)
        # Order as in vLLM: top-k, then top-p over what top-k kept, then min-p (of the best weight, 1).
        floor = tl.full([], 0.0, tl.float32)
        if HAS_TOP_K:
            if top_k > 0:
                k = tl.minimum(top_k, vocab)
                floor = _weight(tl.load(largest_ptr + r * largest_stride + k - 1), top, scale)
        sums, mass = _block_sums(row, vocab, top, scale, floor, NUM_BLOCKS, BLOCK, TILE_BLOCKS)
        target = mass * top_p.to(tl.float64)
        if min_p > floor:
            floor = min_p
            sums, _ = _block_sums(row, vocab, top, scale, floor, NUM_BLOCKS, BLOCK, TILE_BLOCKS)
        lane = tl.full([], 0, tl.int64)
        token = _draw(row, vocab, top, scale, floor, sums, _uniform(key, position, lane), NUM_BLOCKS, BLOCK).to(
            tl.int64
        )
        deciding = top_p < 1.0
        while deciding:
            above = _above(_weight(tl.load(row + token), top, scale))
            sums, heavier = _block_sums(row, vocab, top, scale, above, NUM_BLOCKS, BLOCK, TILE_BLOCKS)
            # The heaviest token is always in the nucleus.
            if (heavier < target) | (heavier <= 0):
                deciding = False
            else:
                # Outside: it and everything as light go, and the heavier tokens are drawn among.
                floor = above
                lane += 1
                if lane == MAX_ROUNDS:
                    floor = _nucleus_floor(row, vocab, top, scale, floor, target, NUM_BLOCKS, BLOCK, TILE_BLOCKS)
                    sums, _ = _block_sums(row, vocab, top, scale, floor, NUM_BLOCKS, BLOCK, TILE_BLOCKS)
                    deciding = False
                token = _draw(row, vocab, top, scale, floor, sums, _uniform(key, position, lane), NUM_BLOCKS, BLOCK).to(
                    tl.int64
                )
    tl.store(tokens_ptr + r, token)
