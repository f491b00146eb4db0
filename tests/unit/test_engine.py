import asyncio
import random
import time

import pytest

from engine.channel import StreamChannel
from engine.request import FinishReason, SamplingParams
from tests.unit.helpers import collect, tiny_engine, tiny_loaded, tokens_of


@pytest.fixture(scope="module")
def loaded(default_tokenizer):
    return tiny_loaded(default_tokenizer)


@pytest.fixture
def engine(loaded):
    engine = tiny_engine(loaded)
    engine.start()
    yield engine
    engine.shutdown()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0)


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_every_stream_ends_with_exactly_one_terminal_chunk(engine):
    chunks = await collect(engine, [1, 2, 3], greedy(5))
    assert [c.is_terminal for c in chunks] == [False] * 4 + [True]
    assert chunks[-1].finish_reason == FinishReason.LENGTH
    assert len(tokens_of(chunks)) == 5


async def test_concurrent_requests_match_the_same_requests_alone(engine):
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    alone = [tokens_of(await collect(engine, p, greedy(10))) for p in prompts]
    together = await asyncio.gather(*[collect(engine, p, greedy(10)) for p in prompts])
    assert [tokens_of(c) for c in together] == alone
    await wait_for(lambda: engine.stats.kv_blocks_used == 0)


async def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    alone = tokens_of(await collect(engine, [3, 4, 5], params))
    noise = [collect(engine, [9] * 5, SamplingParams(max_tokens=12, temperature=1.0)) for _ in range(4)]
    results = await asyncio.gather(collect(engine, [3, 4, 5], params), *noise)
    assert tokens_of(results[0]) == alone


async def test_cancel_frees_kv_blocks_and_leaves_others_running(engine):
    loop = asyncio.get_running_loop()
    victim = StreamChannel(loop)
    engine.submit("victim", list(range(1, 30)), greedy(500), victim)
    other = asyncio.create_task(collect(engine, [1, 2], greedy(40)))
    async for chunk in victim:
        if chunk.token_ids:
            break
    victim.cancel()
    rest = [c async for c in victim]
    assert rest[-1].finish_reason == FinishReason.CANCELLED
    assert len(tokens_of(await other)) == 40
    await wait_for(lambda: engine.stats.kv_blocks_used == 0)
    engine.block_manager.check_integrity()


async def test_fault_in_a_step_ends_every_live_stream_with_an_error(engine):
    tasks = [asyncio.create_task(collect(engine, [i + 1] * 8, greedy(400))) for i in range(4)]
    await wait_for(lambda: engine.stats.num_running == 4)
    engine.inject_fault()
    for chunks in await asyncio.gather(*tasks):
        assert chunks[-1].finish_reason == FinishReason.ERROR
        assert "injected fault" in chunks[-1].error
    await wait_for(lambda: engine.stats.kv_blocks_used == 0)
    assert engine.alive
    assert len(tokens_of(await collect(engine, [1], greedy(3)))) == 3


async def test_shutdown_ends_live_and_later_requests(loaded):
    engine = tiny_engine(loaded)
    engine.start()
    task = asyncio.create_task(collect(engine, [1, 2, 3], greedy(5000)))
    await wait_for(lambda: engine.stats.num_running == 1)
    await asyncio.to_thread(engine.shutdown)
    assert (await task)[-1].finish_reason == FinishReason.ERROR
    late = await collect(engine, [1], greedy(3))
    assert late[-1].finish_reason == FinishReason.ERROR and not engine.alive


async def test_preemption_under_a_small_kv_pool_keeps_outputs_exact(loaded):
    prompts = [[i + 1] * 12 for i in range(6)]
    roomy = tiny_engine(loaded)
    roomy.start()
    try:
        expected = [tokens_of(await collect(roomy, p, greedy(30))) for p in prompts]
    finally:
        roomy.shutdown()
    tight = tiny_engine(loaded, num_kv_blocks=24, block_size=4)
    tight.start()
    try:
        results = await asyncio.gather(*[collect(tight, p, greedy(30)) for p in prompts])
        assert tight.stats.num_preemptions > 0
        assert [tokens_of(r) for r in results] == expected
        tight.block_manager.check_integrity()
    finally:
        tight.shutdown()
