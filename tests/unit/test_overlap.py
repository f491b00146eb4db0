"""Overlapped steps (engine/step/overlapped.py): a step launched before the one in flight hands back its
tokens. The engine overlaps by default only on a GPU; here a CPU engine is told to, and then runs
the same placeholder path (on a GPU the CUDA tests of test_graphs.py run it with graphs)."""

import asyncio
import random

import pytest

from engine.channel import StreamChannel
from engine.tiny import tiny_engine, tiny_loaded
from engine.types import FinishReason, SamplingParams
from tests.unit.helpers import SAMPLING_KINDS, collect, tokens_of, wait_for


@pytest.fixture(scope="module")
def loaded(default_tokenizer):
    return tiny_loaded(default_tokenizer)


@pytest.fixture
def make_engine(loaded):
    engines = []

    def make(overlap: bool, **overrides):
        engine = tiny_engine(loaded, overlap_steps=overlap, **overrides)
        if overlap:
            # Count the steps whose inputs held placeholders: proof that steps did overlap.
            engine.overlapped = 0
            execute = engine.runner.execute

            def counting(plan, resolve=None):
                engine.overlapped += resolve is not None
                return execute(plan, resolve)

            engine.runner.execute = counting
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def mixed_requests(count: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded sampled requests of every truncation, prompts longer than a step's budget."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(1, 500) for _ in range(rng.randint(1, 60))],
            SamplingParams(max_tokens=rng.randint(1, 24), seed=i, **SAMPLING_KINDS[i % len(SAMPLING_KINDS)]),
        )
        for i in range(count)
    ]


async def run_all(engine, requests):
    results = await asyncio.gather(*[collect(engine, prompt, params) for prompt, params in requests])
    await wait_for(lambda: engine.stats.kv_blocks_used == 0)
    return [(tokens_of(chunks), chunks[-1].finish_reason) for chunks in results]


async def test_overlapped_steps_give_the_tokens_of_plain_steps(make_engine):
    requests = mixed_requests(24, seed=5)
    plain = await run_all(make_engine(False), requests)
    engine = make_engine(True)
    assert await run_all(engine, requests) == plain
    # And again with every block of those prompts in the prefix cache.
    assert await run_all(engine, requests) == plain
    assert engine.overlapped > 10


async def test_a_stop_token_found_late_ends_the_output_where_plain_steps_do(make_engine):
    prompt = [7, 8, 9]
    free_run = tokens_of(await collect(make_engine(False), prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    # The token computed after the stop, while the stop was still on the device, is never shown.
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=frozenset({free_run[4]}))
    cut = free_run[: free_run.index(free_run[4]) + 1]
    engine = make_engine(True)
    noise = [collect(engine, [9, 10 + i], SamplingParams(max_tokens=12, temperature=0.0)) for i in range(4)]
    chunks, *_ = await asyncio.gather(collect(engine, prompt, params), *noise)
    assert tokens_of(chunks) == cut and chunks[-1].finish_reason == FinishReason.STOP
    await wait_for(lambda: engine.stats.kv_blocks_used == 0)
    assert engine.overlapped > 0


async def test_requests_that_read_their_output_on_the_host_run_in_plain_steps_beside_the_rest(make_engine):
    """Penalties and logprobs read the tokens so far: steps holding such a request wait for its tokens."""
    requests = mixed_requests(8, seed=9) + [
        ([5, 6, 7], SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=1.5)),
        ([5, 6, 8], SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)),
        ([5, 6, 9], SamplingParams(max_tokens=16, temperature=0.9, seed=1, n=2)),
    ]
    plain = await run_all(make_engine(False), requests)
    assert await run_all(make_engine(True), requests) == plain


async def test_a_cancel_during_overlapped_steps_frees_every_block(make_engine):
    engine = make_engine(True)
    loop = asyncio.get_running_loop()
    victim = StreamChannel(loop, num_choices=1)
    engine.submit("victim", [1, 2, 3], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), victim)
    others = [collect(engine, [4, 5, i], SamplingParams(max_tokens=40, temperature=0.0)) for i in range(6)]
    others_done = asyncio.gather(*others)
    await wait_for(lambda: victim.unread_tokens >= 8 or engine.overlapped > 20)
    victim.cancel()
    results = await others_done
    assert all(chunks[-1].finish_reason == FinishReason.LENGTH for chunks in results)
    await wait_for(lambda: engine.stats.kv_blocks_used == 0 and engine.stats.num_running == 0)
    stats = engine.stats
    assert engine.block_manager.num_free + stats.kv_blocks_used == stats.kv_blocks_total
    assert engine.overlapped > 0


async def test_preemptions_between_overlapped_steps_recompute_the_same_tokens(make_engine):
    """A pool too small for everyone: requests are preempted and recomputed between overlapped steps."""
    requests = [([1 + i, 2, 3], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(4)]
    small = dict(num_kv_blocks=30, block_size=4)
    plain = await run_all(make_engine(False, **small), requests)
    engine = make_engine(True, **small)
    assert await run_all(engine, requests) == plain
    assert engine.stats.num_preemptions > 0 and engine.overlapped > 0
    engine.block_manager.check_integrity(engine.scheduler.requests())


async def test_a_stop_string_found_late_ends_the_output_where_plain_steps_do(make_engine):
    prompt = [11, 12, 13]
    chunks = await collect(make_engine(False), prompt, SamplingParams(max_tokens=16, temperature=0.0))
    text = "".join(chunk.text for chunk in chunks)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=(stop,))
    noise = SamplingParams(max_tokens=16, temperature=0.0)
    plain = make_engine(False)
    engine = make_engine(True)
    expected = await asyncio.gather(collect(plain, prompt, params), *[collect(plain, [9, i], noise) for i in range(4)])
    got = await asyncio.gather(collect(engine, prompt, params), *[collect(engine, [9, i], noise) for i in range(4)])

    def outputs(results):
        return [("".join(c.text for c in chunks), tokens_of(chunks), chunks[-1].finish_reason) for chunks in results]

    assert outputs(got) == outputs(expected)
    assert stop not in outputs(got)[0][0] and outputs(got)[0][2] == FinishReason.STOP
    await wait_for(lambda: engine.stats.kv_blocks_used == 0)
    assert engine.overlapped > 0
