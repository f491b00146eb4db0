import pytest
import torch

from engine.model.causal_lm import PagedCausalLM
from engine.sizing import (
    choose_sizes,
    gpu_kv_cache_bytes,
    graph_pool_bytes,
    max_idle_cached_blocks,
    num_kv_blocks,
    step_activation_bytes,
)
from engine.tiny import tiny_hf_model

GIB = 2**30
# The expected figures are worked out here from the tiny model's shape (engine/tiny.py: 64 hidden,
# 128 intermediate, 4 heads and 2 KV heads of 16 dimensions, 512 tokens, float32), not by the
# functions under test. One token's tensors in one layer: 4 hidden states, q/k/v and 3 MLP intermediates.
LAYER_BYTES = (4 * 64 + (4 + 2 * 2) * 16 + 3 * 128) * 4
VOCAB = 512


def activations(num_tokens: int, num_rows: int, context: int) -> int:
    """Twice a step's tensors: each token's layer and its float32 scores over `context` keys in each of
    the 4 heads, and each row's float32 logits three times."""
    return 2 * (num_tokens * (LAYER_BYTES + 4 * context * 4) + num_rows * VOCAB * 4 * 3)


def graph_pool(max_num_seqs: int) -> int:
    """Twice the largest captured decode step: each row's layer and its logits in float32 twice."""
    return 2 * max_num_seqs * (LAYER_BYTES + VOCAB * (4 + 4))


@pytest.fixture
def model() -> PagedCausalLM:
    return PagedCausalLM(tiny_hf_model())


@pytest.fixture
def gpu_model(model) -> PagedCausalLM:
    # The sizing reads only the model's shape and its device: the arithmetic is checked without a GPU.
    model.device = torch.device("cuda", 0)
    return model


@pytest.fixture
def gpu_model_copy() -> PagedCausalLM:
    model = PagedCausalLM(tiny_hf_model())
    model.device = torch.device("cuda", 0)
    return model


def test_a_cpu_keeps_its_fixed_defaults_and_the_flags_win(model):
    sizing = choose_sizes(model, None, None, None, 0.9, 1024)
    assert (sizing.max_num_seqs, sizing.max_num_batched_tokens, sizing.kv_cache_bytes) == (64, 256, 2 * GIB)
    sizing = choose_sizes(model, 8, 512, 0.5, 0.9, 1024)
    assert (sizing.max_num_seqs, sizing.max_num_batched_tokens, sizing.kv_cache_bytes) == (8, 512, GIB // 2)


def test_a_gpu_gets_256_streams_and_the_memory_the_utilization_leaves(gpu_model):
    free, total = 70 * GIB, 80 * GIB
    sizing = choose_sizes(gpu_model, None, None, None, 0.9, 1024, memory_info=lambda: (free, total))
    assert (sizing.max_num_seqs, sizing.max_num_batched_tokens) == (256, 2048)
    assert sizing.kv_cache_bytes == int(0.9 * total) - (total - free) - activations(2048, 256, 1024)
    assert "0.9 x 80.0 GiB - 10.00 GiB in use" in sizing.explanation
    # An explicit size is taken as given, without asking the device.
    sizing = choose_sizes(gpu_model, None, None, 16, 0.9, 1024, memory_info=lambda: pytest.fail("asked the GPU"))
    assert sizing.kv_cache_bytes == 16 * GIB


def test_speculation_sets_aside_logits_for_every_proposal(gpu_model):
    memory = lambda: (70 * GIB, 80 * GIB)  # noqa: E731
    plain = choose_sizes(gpu_model, 64, 2048, None, 0.9, 1024, memory_info=memory)
    speculating = choose_sizes(gpu_model, 64, 2048, None, 0.9, 1024, rows_per_seq=7, memory_info=memory)
    # 6 more logits rows per request.
    assert plain.kv_cache_bytes - speculating.kv_cache_bytes == 2 * 64 * 6 * VOCAB * 4 * 3
    # Never more logits rows than the step has tokens: 512, not 256 x 7.
    capped = choose_sizes(gpu_model, 256, 512, None, 0.9, 1024, rows_per_seq=7, memory_info=memory)
    assert int(0.9 * 80 * GIB) - 10 * GIB - capped.kv_cache_bytes == activations(512, 512, 1024)


def test_cuda_graphs_set_aside_their_pool(gpu_model):
    memory = lambda: (70 * GIB, 80 * GIB)  # noqa: E731
    eager = choose_sizes(gpu_model, None, None, None, 0.9, 1024, memory_info=memory)
    graphs = choose_sizes(gpu_model, None, None, None, 0.9, 1024, memory_info=memory, cuda_graphs=True)
    assert eager.kv_cache_bytes - graphs.kv_cache_bytes == graph_pool(256)
    assert "GiB for CUDA graphs" in graphs.explanation and "CUDA graphs" not in eager.explanation
    # The pool is the largest bucket's: it grows with --max-num-seqs.
    assert graph_pool_bytes(gpu_model, 64) == graph_pool(64)


def test_activations_grow_with_tokens_rows_and_context(model):
    for num_tokens, num_rows, context in ((256, 256, 1024), (512, 256, 1024), (256, 512, 1024), (256, 256, 2048)):
        assert step_activation_bytes(model, num_tokens, num_rows, context) == activations(num_tokens, num_rows, context)


def test_a_full_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        gpu_kv_cache_bytes(total=80 * GIB, free=5 * GIB, utilization=0.9, activations=GIB)


def test_blocks_count_the_draft_s_cache_too(model):
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
    assert num_kv_blocks(per_token * 16 * 10, 16, model) == 10
    assert num_kv_blocks(per_token * 16 * 10, 16, model, model) == 5


def test_the_idle_cache_is_bounded_on_a_cpu_and_not_on_a_gpu_unless_asked(model, gpu_model_copy):
    block = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4 * 16
    assert max_idle_cached_blocks(None, 16, model) == GIB // 4 // block
    assert max_idle_cached_blocks(0.5, 16, model, model) == GIB // 2 // (2 * block)
    assert max_idle_cached_blocks(0, 16, model) == 0
    assert max_idle_cached_blocks(None, 16, gpu_model_copy) is None
    assert max_idle_cached_blocks(1, 16, gpu_model_copy) == GIB // block
