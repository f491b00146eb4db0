import pytest
import torch

from engine.model.causal_lm import PagedCausalLM
from engine.sizing import choose_sizes, gpu_kv_cache_bytes, graph_pool_bytes, num_kv_blocks, step_activation_bytes
from tests.unit.helpers import tiny_hf_model

GIB = 2**30


@pytest.fixture
def model() -> PagedCausalLM:
    return PagedCausalLM(tiny_hf_model())


@pytest.fixture
def gpu_model(model) -> PagedCausalLM:
    # The sizing reads only the model's shape and its device: the arithmetic is checked without a GPU.
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
    activations = step_activation_bytes(gpu_model, 2048, 256, 1024)
    assert sizing.kv_cache_bytes == int(0.9 * total) - (total - free) - activations
    assert "0.9 x 80.0 GiB - 10.00 GiB in use" in sizing.explanation
    # An explicit size is taken as given, without asking the device.
    sizing = choose_sizes(gpu_model, None, None, 16, 0.9, 1024, memory_info=lambda: pytest.fail("asked the GPU"))
    assert sizing.kv_cache_bytes == 16 * GIB


def test_speculation_sets_aside_logits_for_every_proposal(gpu_model):
    memory = lambda: (70 * GIB, 80 * GIB)  # noqa: E731
    plain = choose_sizes(gpu_model, 64, 2048, None, 0.9, 1024, memory_info=memory)
    speculating = choose_sizes(gpu_model, 64, 2048, None, 0.9, 1024, rows_per_seq=7, memory_info=memory)
    set_aside = step_activation_bytes(gpu_model, 2048, 64 * 7, 1024) - step_activation_bytes(gpu_model, 2048, 64, 1024)
    assert plain.kv_cache_bytes - speculating.kv_cache_bytes == set_aside > 0
    # Never more logits rows than the step has tokens.
    capped = choose_sizes(gpu_model, 256, 512, None, 0.9, 1024, rows_per_seq=7, memory_info=memory)
    uncapped_rows = step_activation_bytes(gpu_model, 512, 256 * 7, 1024)
    assert int(0.9 * 80 * GIB) - 10 * GIB - capped.kv_cache_bytes == step_activation_bytes(gpu_model, 512, 512, 1024)
    assert step_activation_bytes(gpu_model, 512, 512, 1024) < uncapped_rows


def test_cuda_graphs_set_aside_their_pool(gpu_model):
    memory = lambda: (70 * GIB, 80 * GIB)  # noqa: E731
    eager = choose_sizes(gpu_model, None, None, None, 0.9, 1024, memory_info=memory)
    graphs = choose_sizes(gpu_model, None, None, None, 0.9, 1024, memory_info=memory, cuda_graphs=True)
    assert eager.kv_cache_bytes - graphs.kv_cache_bytes == graph_pool_bytes(gpu_model, 256) > 0
    assert "GiB for CUDA graphs" in graphs.explanation and "CUDA graphs" not in eager.explanation
    # The pool is the largest bucket's: it grows with --max-num-seqs, and holds each row's logits twice.
    rows = graph_pool_bytes(gpu_model, 128) - graph_pool_bytes(gpu_model, 64)
    assert rows == graph_pool_bytes(gpu_model, 64) > 2 * 64 * gpu_model.vocab_size * (4 + 4)


def test_activations_grow_with_tokens_rows_and_context(model):
    base = step_activation_bytes(model, 256, 256, 1024)
    assert step_activation_bytes(model, 512, 256, 1024) > base
    assert step_activation_bytes(model, 256, 512, 1024) - base == 2 * 256 * model.vocab_size * 4 * 3
    # Attention scores: every head, each of the step's tokens over the longest context, float32.
    assert step_activation_bytes(model, 256, 256, 2048) - base == 2 * 256 * model.num_heads * 1024 * 4


def test_a_full_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        gpu_kv_cache_bytes(total=80 * GIB, free=5 * GIB, utilization=0.9, activations=GIB)


def test_blocks_count_the_draft_s_cache_too(model):
    per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
    assert num_kv_blocks(per_token * 16 * 10, 16, model) == 10
    assert num_kv_blocks(per_token * 16 * 10, 16, model, model) == 5
