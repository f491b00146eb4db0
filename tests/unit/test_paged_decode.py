"""The Triton paged decode kernel against SDPA over the same keys, on random paged layouts. On a
machine without CUDA it runs in Triton's interpreter on the CPU; without Triton it skips."""

import pytest
import torch
import torch.nn.functional as F

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET: the kernel runs in Triton's interpreter.
pytest.importorskip("triton", reason="the GPU decode kernel is written in Triton")
pytestmark = pytest.mark.interpreter

from engine.kernels.gpu.paged_decode import paged_decode_attention, supports  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _layout(lengths, block_size, num_blocks, shared_blocks, generator):
    """Block tables for requests of `lengths`: the first `shared_blocks` blocks are one shared prefix,
    the rest scattered through the cache."""
    free = torch.randperm(num_blocks, generator=generator).tolist()
    prefix = [free.pop() for _ in range(shared_blocks)]
    tables = []
    for length in lengths:
        needed = -(-length // block_size)
        own = prefix[: min(shared_blocks, needed)]
        tables.append(own + [free.pop() for _ in range(needed - len(own))])
    width = max(map(len, tables))
    return [t + [0] * (width - len(t)) for t in tables]


def _reference(q, k_cache, v_cache, tables, lengths, block_size, scale):
    out = []
    for i, length in enumerate(lengths):
        slots = torch.tensor([tables[i][p // block_size] * block_size + p % block_size for p in range(length)])
        k, v = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v, scale=scale, enable_gqa=True).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("block_size", "heads", "kv_heads", "head_dim"), [(16, 6, 2, 64), (32, 8, 8, 64), (16, 4, 1, 80), (32, 9, 3, 128)]
)
def test_the_kernel_matches_sdpa_and_a_decode_is_the_same_alone(block_size, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(block_size + heads)
    num_blocks = 40
    lengths = [1, block_size, block_size + 1, 3 * block_size - 5, 77, 200]
    tables = _layout(lengths, block_size, num_blocks, shared_blocks=2, generator=generator)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    q = torch.randn(len(lengths), heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    expected = _reference(q, k_cache, v_cache, tables, lengths, block_size, scale)

    def run(rows):
        return paged_decode_attention(
            q[rows].to(DEVICE),
            k_cache.to(DEVICE),
            v_cache.to(DEVICE),
            torch.tensor([tables[i] for i in rows], device=DEVICE),
            torch.tensor([lengths[i] for i in rows], device=DEVICE),
            block_size,
            scale,
        ).cpu()

    together = run(list(range(len(lengths))))
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-5)
    for i in range(len(lengths)):
        assert torch.equal(run([i])[0], together[i]), i


def test_shapes_the_kernel_does_not_take():
    assert supports(16, 64) and supports(32, 128)
    assert not supports(8, 64) and not supports(24, 64) and not supports(16, 512)
