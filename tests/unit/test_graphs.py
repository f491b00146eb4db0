"""Decode steps replayed from static buffers, padded to their batch bucket (engine/model/graphs.py).

Without a GPU nothing can be captured: the "capture" given to the runner is the static forward itself,
run at each replay, so these tests check everything around torch.cuda.graph (the buffers filled in
place, the bucket padding, the scratch block) through Triton's interpreter. On CUDA every test
captures real graphs."""

import asyncio
import random
from array import array

import pytest
import torch

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET: the decode kernel runs in Triton's interpreter.
pytest.importorskip("triton", reason="graphs replay the Triton paged decode kernel")
pytestmark = pytest.mark.interpreter

from engine.channel import StreamChannel  # noqa: E402
from engine.config import SpeculativeConfig  # noqa: E402
from engine.model.attention.triton_paged import gpu_attention  # noqa: E402
from engine.model.graphs import CudaGraphCapture, batch_buckets, run_eagerly  # noqa: E402
from engine.model.runner import Logits, ModelRunner, Segment  # noqa: E402
from engine.tiny import tiny_engine, tiny_hf_model, tiny_loaded  # noqa: E402
from engine.types import FinishReason, SamplingParams  # noqa: E402
from tests.unit.helpers import collect, hf_greedy, make_request, tokens_of, wait_for  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels(model):
    return gpu_attention(torch.device("cuda"), 16, model.num_heads, model.num_kv_heads, model.head_dim)


def _recording_capture(sizes):
    """The runner's capture, noting the rows of each replay: on CUDA real graphs; elsewhere the bucket's
    static forward run at each replay (run_eagerly)."""
    inner = CudaGraphCapture() if torch.cuda.is_available() else run_eagerly

    def capture(forward):
        run = inner(forward)

        def replay():
            output = run()
            sizes.append(output.logits.shape[0])
            return output

        return replay

    return capture


def test_buckets_are_powers_of_two_to_8_then_steps_of_16():
    assert batch_buckets(1) == [1]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256] and len(batch_buckets(256)) == 20


@pytest.mark.parametrize("overlap", [False, True])
async def test_replayed_decode_steps_give_the_tokens_of_eager_steps(default_tokenizer, overlap):
    """Twelve requests that end one after another, so the batch shrinks through every bucket, most
    steps padded (11 rows in 12, 7 in 8, ...); prompts prefilled in chunks run eagerly in between.
    With overlapped steps (engine/future_tokens.py) the graphs read placeholder token ids."""
    loaded = tiny_loaded(default_tokenizer, device=DEVICE)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 400) for _ in range(rng.randint(3, 40))] for _ in range(12)]
    # The first request, whose blocks come first in the pool (block 0, where a padding row writing into
    # the pool would most likely land), decodes longest.
    lengths = [36 - 3 * i for i in range(12)]

    async def run(replayed):
        engine = tiny_engine(loaded, block_size=16, max_num_seqs=12, overlap_steps=overlap)
        engine.runner.gpu_attention = _kernels(loaded.model)
        # On CUDA the engine has captured graphs of its own: the eager run drops them.
        engine.runner.graphs = None
        execute, resolved_steps = engine.runner.execute, []

        def counting(plan, resolve=None):
            resolved_steps.append(resolve is not None)
            return execute(plan, resolve)

        engine.runner.execute = counting
        if replayed is not None:
            assert engine.runner.capture_decode_graphs(12, 1024, capture=_recording_capture(replayed))
        engine.start()
        try:
            results = await asyncio.gather(
                *[
                    collect(engine, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
                    for p, n in zip(prompts, lengths)
                ]
            )
            await wait_for(lambda: engine.stats.kv_blocks_used == 0)
            engine.block_manager.check_integrity(engine.scheduler.requests())
        finally:
            engine.shutdown()
        assert any(resolved_steps) == overlap
        return [tokens_of(chunks) for chunks in results]

    replayed = []
    eager = await run(None)
    assert [len(tokens) for tokens in eager] == lengths
    assert await run(replayed) == eager
    assert set(replayed) == {1, 2, 4, 8, 12}


async def test_a_cancel_between_replays_frees_the_request_s_blocks(default_tokenizer):
    loaded = tiny_loaded(default_tokenizer, device=DEVICE)
    engine = tiny_engine(loaded, block_size=16, max_num_seqs=4)
    engine.runner.gpu_attention = _kernels(loaded.model)
    replayed = []
    engine.runner.capture_decode_graphs(4, 1024, capture=_recording_capture(replayed))
    engine.start()
    try:
        victim = StreamChannel(asyncio.get_running_loop())
        engine.submit("victim", list(range(1, 30)), SamplingParams(max_tokens=500, temperature=0.0), victim)
        other = asyncio.create_task(collect(engine, [1, 2], SamplingParams(max_tokens=30, temperature=0.0)))
        async for chunk in victim:
            if len(chunk.token_ids) and replayed:
                break
        victim.cancel()
        rest = [c async for c in victim]
        assert rest[-1].finish_reason == FinishReason.CANCELLED
        assert len(tokens_of(await other)) == 30
        await wait_for(lambda: engine.stats.kv_blocks_used == 0)
        engine.block_manager.check_integrity(engine.scheduler.requests())
    finally:
        engine.shutdown()


async def test_a_preemption_between_replays_recomputes_the_same_tokens(default_tokenizer):
    """A pool of 8 blocks of 16 tokens for four requests that grow to 60 tokens each: the youngest are
    preempted and recomputed while the others' decode steps replay, and every request still gets the
    eager path's tokens."""
    loaded = tiny_loaded(default_tokenizer, device=DEVICE)
    prompts = [[10 + i] * 20 for i in range(4)]

    async def run(replayed):
        engine = tiny_engine(loaded, block_size=16, max_num_seqs=4, num_kv_blocks=8)
        engine.runner.gpu_attention = _kernels(loaded.model)
        engine.runner.graphs = None
        if replayed is not None:
            engine.runner.capture_decode_graphs(4, 1024, capture=_recording_capture(replayed))
        engine.start()
        try:
            results = await asyncio.gather(
                *[collect(engine, p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for p in prompts]
            )
            await wait_for(lambda: engine.stats.kv_blocks_used == 0)
            engine.block_manager.check_integrity(engine.scheduler.requests())
            preemptions = engine.stats.num_preemptions
        finally:
            engine.shutdown()
        return [tokens_of(chunks) for chunks in results], preemptions

    replayed = []
    eager, _ = await run(None)
    tokens, preemptions = await run(replayed)
    assert preemptions > 0 and replayed
    assert tokens == eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_captured_graphs_give_the_eager_logits_for_every_batch_size(default_tokenizer):
    """Float32. Eager through the same padded buckets (--enforce-eager) runs the very kernels the graph
    recorded, at the same shapes: identical logits at every batch size. Eager without the padding is
    identical at bucket sizes; between them it may get other GEMM kernels for its other row count, so close."""
    loaded = tiny_loaded(default_tokenizer, device="cuda")
    runner = ModelRunner(loaded.model, num_blocks=64, block_size=16)
    for storage in (runner.kv_cache.key, runner.kv_cache.value):
        storage.normal_()
    assert runner.capture_decode_graphs(max_num_seqs=20, max_model_len=256, capture=run_eagerly)
    padded_eager = runner.graphs
    assert runner.capture_decode_graphs(max_num_seqs=20, max_model_len=256)
    graphs = runner.graphs
    rng = random.Random(5)
    for n in range(1, 21):
        segments = []
        for i in range(n):
            request = make_request(prompt_len=rng.randint(1, 100))
            request.block_table = array("q", rng.sample(range(64), 8))
            start = rng.randrange(0, 8 * 16)
            segments.append(Segment(request, start, [rng.randrange(1, 500)], Logits.LAST))
        replayed = runner.run(segments).logits.clone()
        runner.graphs = padded_eager
        assert torch.equal(runner.run(segments).logits, replayed), n
        runner.graphs = None
        eager = runner.run(segments).logits
        runner.graphs = graphs
        if n in graphs.buckets:
            assert torch.equal(replayed, eager), n
        else:
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
async def test_enforce_eager_gives_the_graphs_tokens_in_bfloat16(default_tokenizer):
    """bfloat16, where rounding differences would show soon: 16 streams of different lengths, so the
    batch shrinks through the buckets, give the same greedy tokens with graphs and with --enforce-eager."""
    loaded = tiny_loaded(default_tokenizer, device="cuda", dtype=torch.bfloat16)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 400) for _ in range(rng.randint(3, 40))] for _ in range(16)]

    async def tokens(enforce_eager):
        engine = tiny_engine(loaded, block_size=16, max_num_seqs=16, enforce_eager=enforce_eager)
        engine.start()
        try:
            results = await asyncio.gather(
                *[
                    collect(engine, p, SamplingParams(max_tokens=8 + 2 * i, temperature=0.0))
                    for i, p in enumerate(prompts)
                ]
            )
        finally:
            engine.shutdown()
        return [tokens_of(chunks) for chunks in results]

    assert await tokens(enforce_eager=True) == await tokens(enforce_eager=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", num_tokens=4, max_batch_size=16)])
async def test_greedy_float32_through_graphs_equals_hf_generate_for_16_streams(default_tokenizer, speculative):
    """The engine as a server builds it on a GPU (graphs captured, the Triton kernels), 16 streams."""
    loaded = tiny_loaded(default_tokenizer, repetitive=speculative is not None, device="cuda")
    reference = tiny_hf_model(repetitive=speculative is not None).to("cuda")
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 400) for _ in range(rng.randint(3, 40))] for _ in range(16)]
    expected = [hf_greedy(reference, p, 24) for p in prompts]
    engine = tiny_engine(loaded, block_size=16, max_num_seqs=16, speculative=speculative)
    assert engine.runner.graphs is not None
    engine.start()
    try:
        results = await asyncio.gather(
            *[collect(engine, p, SamplingParams(max_tokens=24, temperature=0.0)) for p in prompts]
        )
    finally:
        engine.shutdown()
    assert [tokens_of(chunks) for chunks in results] == expected
