"""--kv-cache-dtype bfloat16 / float16 on the batch-invariant CPU kernels: the cache holds torch's rounding of
each float32 key and value, in the one-call decoder and op by op; outputs stay the same alone, in a mixed batch,
chunked and from the prefix cache; the same --kv-cache-gib holds twice the blocks; and where the attention
would not widen the cache exactly (torch's SDPA, so also a GPU) a narrower cache is refused at start."""

import asyncio

import pytest
import torch

from app.settings import Settings
from app.state import build_engine
from engine.detokenizer import IncrementalDetokenizer, StopMatcher
from engine.engine import Engine
from engine.model.runner import Logits, Segment
from engine.request import Request
from engine.tiny import tiny_engine, tiny_hf_model, tiny_loaded
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import collect

NARROW = [torch.bfloat16, torch.float16]
PROMPTS = [list(range(20, 60)), [5, 9, 13], [7] * 11]
# float32 keys and values where rounding is easy to get wrong: ties to even (bfloat16 keeps 8 significant bits,
# float16 11), just either side of a tie, overflow to infinity (float32's largest, float16's 65520), float32
# and float16 subnormals, zero; then ordinary values. (No -0.0: a sum of products that starts from 0 cannot give it.)
EDGES = [
    1 + 2**-8,
    1 + 3 * 2**-8,
    -(1 + 2**-8),
    1 + 2**-8 + 2**-20,
    1 + 2**-8 - 2**-20,
    3.4028234663852886e38,
    -3.4028234663852886e38,
    1e-40,
    -1e-40,
    0.0,
    -3e-8,
    1 + 2**-11,
    1 + 3 * 2**-11,
    -(1 + 3 * 2**-11),
    65504.0,
    65519.99,
    65520.0,
    -1e5,
    1.5 * 2**-24,
    2**-25,
    2**-25 + 2**-40,
    2**-26,
    6.1e-5,
    1e-7,
    0.1,
    -1 / 3,
    3.14159,
    1000.1,
    12345.678,
    -2.5e-3,
    7.0,
    -0.75,
]


def _edge_model():
    """A Llama whose first layer's keys and values are EDGES, exactly, for every token at position 0 (and its
    values at any position): embeddings of ones, which an RMSNorm without epsilon leaves ones, and key and value
    projections that pick one of EDGES per output (a sum of one product by 1 and zeros is exact). Rotary leaves
    a key at position 0 as it is."""
    hf = tiny_hf_model("llama", rms_norm_eps=0.0)
    attention = hf.model.layers[0].self_attn
    edges = torch.tensor(EDGES, dtype=torch.float32)
    with torch.no_grad():
        hf.model.embed_tokens.weight.fill_(1.0)
        for projection in (attention.k_proj, attention.v_proj):
            projection.weight.zero_()
            projection.weight[torch.arange(len(EDGES)), torch.arange(len(EDGES))] = edges
    return hf


def _first_layer_cache(engine: Engine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's cached keys and values [len(prompt), KVH, D] after one forward of `prompt`."""
    request = Request(
        request_id="edges",
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=1, temperature=0.0),
        channel=None,
        detokenizer=IncrementalDetokenizer(engine.token_bytes),
        stop_matcher=StopMatcher(()),
    )
    engine.block_manager.allocate(request, len(prompt))
    engine.runner.run([Segment(request, 0, request.token_ids, Logits.ALL)])
    size = engine.runner.block_size
    slots = torch.tensor([request.block_table[p // size] * size + p % size for p in range(len(prompt))])
    cache = engine.runner.kv_cache
    return cache.key[0][slots].clone(), cache.value[0][slots].clone()


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that -0.0 differs from 0.0 and infinities compare."""
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("one_call", [True, False], ids=["decoder", "op-by-op"])
@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_the_cache_holds_torchs_rounding_of_each_float32_key_and_value(default_tokenizer, dtype, one_call):
    loaded = tiny_loaded(default_tokenizer, kernels_cache=CACHE_DIR, hf_model=_edge_model())
    model = loaded.model
    assert model._decoder is not None
    if not one_call:
        model._decoder = None
    prompt = [3, 3, 3]
    float_keys, float_values = _first_layer_cache(tiny_engine(loaded), prompt)
    edges = torch.tensor(EDGES, dtype=torch.float32).view(float_keys.shape[1:])
    # The float32 cache holds EDGES themselves: the model computes what _edge_model says.
    assert torch.equal(_bits(float_keys[0]), _bits(edges))
    assert torch.equal(_bits(float_values), _bits(edges.expand_as(float_values)))
    model.use_kv_dtype(dtype)
    keys, values = _first_layer_cache(tiny_engine(loaded), prompt)
    assert keys.dtype == values.dtype == dtype
    assert torch.equal(_bits(keys[0]), _bits(float_keys[0].to(dtype)))
    assert torch.equal(_bits(values), _bits(float_values.to(dtype)))


PARAMS = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)


async def _outputs(engine: Engine, *prompt_lists: list[list[int]]) -> list[list[list[tuple[int, float]]]]:
    """Greedy tokens and logprobs of each list of prompts, the lists one after another on one engine (so a later
    list reads an earlier one's blocks from the prefix cache)."""
    engine.start()
    try:
        outputs = []
        for prompts in prompt_lists:
            results = await asyncio.gather(*[collect(engine, p, PARAMS) for p in prompts])
            outputs.append([[(lp.token_id, lp.logprob) for c in r for lp in c.logprobs] for r in results])
    finally:
        engine.shutdown()
    return outputs


@pytest.mark.parametrize("dtype", NARROW, ids=str)
@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])  # the one-call decoder; op by op, window and caps
async def test_outputs_depend_on_the_request_alone(default_tokenizer, model_type, dtype):
    loaded = tiny_loaded(default_tokenizer, model_type, kernels_cache=CACHE_DIR)
    (float32,) = await _outputs(tiny_engine(loaded), PROMPTS)
    loaded.model.use_kv_dtype(dtype)
    assert tiny_engine(loaded).runner.kv_cache.key.dtype == dtype
    alone = [(await _outputs(tiny_engine(loaded), [p]))[0][0] for p in PROMPTS]
    assert all(len(output) == PARAMS.max_tokens for output in alone)
    assert await _outputs(tiny_engine(loaded), PROMPTS) == [alone]
    # Prompts chunked across block edges, mixed with decodes.
    assert await _outputs(tiny_engine(loaded, max_num_batched_tokens=5), PROMPTS) == [alone]
    engine = tiny_engine(loaded)
    assert await _outputs(engine, PROMPTS, PROMPTS[::-1]) == [alone, alone[::-1]]
    assert engine.block_manager.num_prefix_hits > 0
    # Rounded keys: other bits than a float32 cache's, close to them.
    assert alone != float32
    assert [output[0][0] for output in alone] == [output[0][0] for output in float32]
    assert [output[0][1] for output in alone] == pytest.approx([output[0][1] for output in float32], abs=0.05)


def _saved_tiny_model(folder, tokenizer) -> str:
    tiny_hf_model().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _settings(folder: str, **flags) -> Settings:
    return Settings(_cli_parse_args=False, model=folder, cache_dir=CACHE_DIR, device="cpu", **flags)


def test_the_same_kv_cache_gib_holds_twice_the_blocks(tmp_path, default_tokenizer):
    folder = _saved_tiny_model(tmp_path, default_tokenizer)
    engines = {
        dtype: build_engine(_settings(folder, kv_cache_gib=2**-10, kv_cache_dtype=dtype))[1]
        for dtype in ("auto", "bfloat16", "float16")
    }
    blocks = {dtype: engine.config.num_kv_blocks for dtype, engine in engines.items()}
    assert blocks["bfloat16"] == blocks["float16"] == 2 * blocks["auto"]
    pool_bytes = {}
    for dtype, engine in engines.items():
        cache = engine.runner.kv_cache
        assert cache.key.dtype == (torch.float32 if dtype == "auto" else getattr(torch, dtype))
        # The pool's blocks, then one scratch block past them.
        assert cache.key.shape[1] == (blocks[dtype] + 1) * engine.config.block_size
        pool_bytes[dtype] = (cache.key.nbytes + cache.value.nbytes) * blocks[dtype] // (blocks[dtype] + 1)
    assert pool_bytes["bfloat16"] == pool_bytes["float16"] == pool_bytes["auto"] == 2**20


def test_a_narrower_cache_is_refused_off_the_batch_invariant_cpu_kernels(tmp_path, default_tokenizer):
    folder = _saved_tiny_model(tmp_path, default_tokenizer)
    torch_kernels = dict(kv_cache_gib=2**-10, batch_invariant=False, dtype="float32")
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(ValueError, match=f"--kv-cache-dtype {dtype} differs from the model's float32"):
            build_engine(_settings(folder, kv_cache_dtype=dtype, **torch_kernels))
    # The model's own type is what auto gives, on any kernels.
    _, engine = build_engine(_settings(folder, kv_cache_dtype="float32", **torch_kernels))
    assert engine.runner.kv_cache.key.dtype == torch.float32
