"""The Triton paged prefill kernel against SDPA over the same keys, on random paged layouts. On a
machine without CUDA it runs in Triton's interpreter on the CPU; without Triton it skips."""

import pytest
import torch
import torch.nn.functional as F

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET: the kernel runs in Triton's interpreter.
pytest.importorskip("triton", reason="the GPU prefill kernel is written in Triton")
pytestmark = pytest.mark.interpreter

from engine.kernels.gpu.paged_prefill import paged_prefill_attention, queries_per_tile  # noqa: E402
from tests.unit.test_paged_decode import DEVICE, _layout  # noqa: E402


def _tiles(chunk_lens, group):
    per_tile = queries_per_tile(group)
    return [(c, first) for c, n in enumerate(chunk_lens) for first in range(0, n, per_tile)]


def _run(q, k_cache, v_cache, tables, chunks, block_size, scale):
    """The kernel over chunks [(first token in q, tokens, cached before)]; rows outside them stay NaN."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.full_like(q, float("nan"), device=DEVICE)
    paged_prefill_attention(
        q.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        out,
        torch.tensor(tables, device=DEVICE),
        torch.tensor(chunks, device=DEVICE),
        torch.tensor(_tiles([n for _, n, _ in chunks], group), device=DEVICE),
        block_size,
        scale,
    )
    return out.cpu()


def _reference(q, k_cache, v_cache, table, start, num_tokens, num_cached, block_size, scale):
    end = num_cached + num_tokens
    slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(end)])
    k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
    visible = torch.arange(end).unsqueeze(0) <= torch.arange(num_cached, end).unsqueeze(1)
    queries = q[start : start + num_tokens].transpose(0, 1)
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "head_dim"), [(16, 6, 2, 64), (32, 8, 8, 64), (16, 4, 1, 80), (32, 9, 3, 128)]
)
def test_the_kernel_matches_sdpa_on_ragged_chunks_with_cached_prefixes(block_size, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(block_size * heads)
    num_blocks = 48
    # (tokens in the chunk, tokens of the request cached before it): a whole prompt, chunks after a
    # prefix-cache hit or an earlier chunk, ending inside and on a block's edge, a 2-token chunk.
    shapes = [(37, 0), (block_size, block_size), (70, 2 * block_size + 3), (2, 5), (block_size + 1, 0), (45, 90)]
    tables = _layout([n + cached for n, cached in shapes], block_size, num_blocks, 2, generator)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    # Three decode-like rows first, which the kernel must leave alone.
    chunks, start = [], 3
    for n, cached in shapes:
        chunks.append((start, n, cached))
        start += n
    q = torch.randn(start, heads, head_dim, generator=generator)
    scale = head_dim**-0.5

    out = _run(q, k_cache, v_cache, tables, chunks, block_size, scale)
    assert out[:3].isnan().all()
    for c, (start, n, cached) in enumerate(chunks):
        expected = _reference(q, k_cache, v_cache, tables[c], start, n, cached, block_size, scale)
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)


def test_tiles_take_a_fixed_number_of_query_rows():
    assert [queries_per_tile(g) for g in (1, 2, 3, 4, 8, 64, 128)] == [64, 32, 16, 16, 8, 1, 1]
