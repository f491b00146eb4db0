"""The batch-invariant kernels: close to torch's results, and bit for bit the same for a row or a
query whatever else is computed with it."""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu.invariant import KernelAttentionMetadata, PackedLinear, invariant_paged_attention
from engine.kernels.cpu.native import kernels_supported, load_library
from tests.conftest import CACHE_DIR


@pytest.fixture(scope="module")
def library():
    assert kernels_supported(), "these tests run where the kernels do: x86-64 with AVX2"
    library = load_library(CACHE_DIR)
    assert library is not None
    return library


@pytest.mark.parametrize(("out_features", "in_features"), [(576, 576), (192, 1536), (100, 40), (49152, 64)])
def test_a_linear_row_is_the_same_alone_and_in_any_batch(library, out_features, in_features):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    linear = PackedLinear.pack(library, weight)
    x = torch.randn(300, in_features)
    full = linear(x)
    torch.testing.assert_close(full, F.linear(x, weight), rtol=1e-4, atol=1e-3)
    for rows in (1, 2, 3, 5, 6, 7, 13, 48, 64, 255):
        for offset in (0, 7, 45):
            assert torch.equal(linear(x[offset : offset + rows]), full[offset : offset + rows]), (rows, offset)


@pytest.mark.parametrize(("out_features", "rows"), [(100, 7), (576, 13), (1000, 1), (49152, 64)])
def test_the_heads_block_maxima_are_each_blocks_max_and_change_no_output(library, out_features, rows):
    torch.manual_seed(0)
    linear = PackedLinear.pack(library, torch.randn(out_features, 64))
    x = torch.randn(rows, 64)
    out, maxima = linear.with_block_max(x)
    assert torch.equal(out, linear(x))
    blocks = -(-out_features // 256)
    padded = torch.full((rows, blocks * 256), -torch.inf)
    padded[:, :out_features] = out
    assert torch.equal(maxima, padded.view(rows, blocks, 256).amax(dim=-1))


def _paged(library, q, cache, tables, table_rows, context_lens):
    meta = KernelAttentionMetadata(
        library=library,
        block_tables=torch.tensor(tables),
        table_rows=torch.tensor(table_rows),
        context_lens=torch.tensor(context_lens),
        block_size=4,
    )
    return invariant_paged_attention(q, *cache, meta, scale=0.125)


def test_attention_matches_sdpa_and_a_query_reads_the_same_alone_or_in_a_chunk(library):
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 6, 2, 64
    cache = (torch.randn(200, kv_heads, head_dim), torch.randn(200, kv_heads, head_dim))
    # Two requests whose blocks are scattered through the cache.
    tables = [[7, 3, 30, 12, 44, 1, 9, 20, 33], [5, 40, 2, 18, 0, 0, 0, 0, 0]]
    q = torch.randn(12, heads, head_dim)
    # Request 0's positions 20..29 as one chunk, then request 1's position 15 as a decode.
    rows, lens = [0] * 10 + [1, 1], [*range(21, 31), 16, 14]
    out = _paged(library, q, cache, tables, rows, lens)
    for t in range(12):
        slots = torch.tensor([tables[rows[t]][j // 4] * 4 + j % 4 for j in range(lens[t])])
        k, v = (c[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0) for c in cache)
        expected = F.scaled_dot_product_attention(q[t].unsqueeze(1), k, v, scale=0.125).squeeze(1)
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-5)
        alone = _paged(library, q[t : t + 1], cache, [tables[rows[t]]], [0], [lens[t]])
        assert torch.equal(alone[0], out[t]), t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_attention_reads_a_narrower_cache_as_its_exact_values(library, dtype):
    torch.manual_seed(1)
    heads, kv_heads, head_dim = 6, 2, 64
    narrow = (torch.randn(200, kv_heads, head_dim).to(dtype), torch.randn(200, kv_heads, head_dim).to(dtype))
    tables = [[7, 3, 30, 12, 44, 1, 9, 20, 33], [5, 40, 2, 18, 0, 0, 0, 0, 0]]
    q = torch.randn(12, heads, head_dim)
    rows, lens = [0] * 10 + [1, 1], [*range(21, 31), 16, 14]
    widened = tuple(c.float() for c in narrow)
    assert torch.equal(_paged(library, q, narrow, tables, rows, lens), _paged(library, q, widened, tables, rows, lens))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (14, 2, 56), (8, 1, 80), (3, 3, 128), (16, 2, 16), (12, 2, 120)],
)
@pytest.mark.parametrize(
    "variant", [{}, {"softcap": 1.5, "window": 9}, {"sinks": True}], ids=["plain", "capped", "sinks"]
)
def test_each_query_head_of_a_kv_head_s_group_gets_the_bits_it_gets_alone(library, heads, kv_heads, head_dim, variant):
    # The heads of a group share their passes over the keys and values, in chunks of up to four, and a value pass
    # sums as many of a head's vectors as the registers hold (head dims of 7, 15, 10, 16, 2 and 8 vectors take
    # every width of pass); each head's arithmetic is still its own: as with the group's keys and values repeated
    # for each head (a group of one).
    torch.manual_seed(2)
    cache = (torch.randn(200, kv_heads, head_dim), torch.randn(200, kv_heads, head_dim))
    tables = [[7, 3, 30, 12, 44, 1, 9, 20, 33], [5, 40, 2, 18, 0, 0, 0, 0, 0]]
    q = torch.randn(12, heads, head_dim)
    rows, lens = [0] * 10 + [1, 1], [*range(21, 31), 16, 14]
    options = {**variant, "sinks": torch.randn(heads)} if variant.get("sinks") else variant
    meta = KernelAttentionMetadata(library, torch.tensor(tables), torch.tensor(rows), torch.tensor(lens), 4)
    grouped = invariant_paged_attention(q, *cache, meta, 0.125, **options)
    repeated = tuple(c.repeat_interleave(heads // kv_heads, 1) for c in cache)
    assert torch.equal(grouped, invariant_paged_attention(q, *repeated, meta, 0.125, **options))
