import asyncio
import random

import pytest

from engine.channel import StreamChannel
from engine.tiny import tiny_engine, tiny_loaded
from engine.types import FinishReason, SamplingParams
from tests.unit.helpers import SAMPLING_KINDS, collect, collect_handed_over, tokens_of, wait_for


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


async def test_every_stream_ends_with_exactly_one_terminal_chunk(engine):
    chunks = await collect(engine, [1, 2, 3], greedy(5))
    # Up to 5 chunks: a reader that lags (a loaded machine) gets some of them merged.
    assert [c.is_terminal for c in chunks] == [False] * (len(chunks) - 1) + [True] and len(chunks) <= 5
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


async def test_seeded_requests_match_alone_inside_64_mixed_requests(loaded):
    engine = tiny_engine(loaded, max_num_seqs=64, max_num_batched_tokens=512)
    engine.start()
    try:
        rng = random.Random(3)
        requests = [
            (
                [rng.randrange(1, 500) for _ in range(rng.randint(1, 30))],
                SamplingParams(
                    max_tokens=rng.randint(4, 16),
                    seed=rng.choice([None, i]),
                    **SAMPLING_KINDS[i % len(SAMPLING_KINDS)],
                ),
            )
            for i in range(64)
        ]
        watched = [i for i, (_, p) in enumerate(requests) if p.seed is not None or p.greedy]
        alone = {i: tokens_of(await collect(engine, *requests[i])) for i in watched}
        together = await asyncio.gather(*[collect(engine, *r) for r in requests])
        assert {i: tokens_of(together[i]) for i in watched} == alone
    finally:
        engine.shutdown()


async def test_a_step_wakes_the_loop_once_for_all_its_streams(engine, monkeypatch):
    loop = asyncio.get_running_loop()
    wakeups = 0
    original = loop.call_soon_threadsafe

    def counting(*args, **kwargs):
        nonlocal wakeups
        wakeups += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    steps = engine.stats.num_steps
    results = await asyncio.gather(*[collect(engine, [i + 1, 2, 3], greedy(20)) for i in range(8)])
    assert all(len(tokens_of(chunks)) == 20 for chunks in results)
    # 160 chunks in 8 streams, and never more wake-ups than steps (the stats snapshot of the
    # last step may be published after its chunks were read: one step of slack).
    assert 0 < wakeups <= engine.stats.num_steps - steps + 1


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
    engine.block_manager.check_integrity(engine.scheduler.requests())


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


async def test_an_empty_prompt_ends_with_an_error_and_leaves_the_others_running(engine):
    other = asyncio.create_task(collect(engine, [1, 2], greedy(20)))
    await wait_for(lambda: engine.stats.num_running == 1)
    empty = await collect(engine, [], greedy(3))
    assert len(empty) == 1 and empty[0].finish_reason == FinishReason.ERROR and "no tokens" in empty[0].error
    assert len(tokens_of(await other)) == 20 and engine.alive


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
        tight.block_manager.check_integrity(tight.scheduler.requests())
    finally:
        tight.shutdown()


def text_of(chunks):
    return "".join(c.text for c in chunks)


def by_choice(chunks):
    choices = {}
    for chunk in chunks:
        choices.setdefault(chunk.index, []).append(chunk)
    return choices


async def test_n_choices_share_one_prefill_and_each_end_once(engine):
    prompt = list(range(1, 40))
    alone = tokens_of(await collect(engine, prompt, greedy(12)))
    steps_before = engine.stats.num_steps
    chunks = await collect(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0, n=3))
    choices = by_choice(chunks)
    assert sorted(choices) == [0, 1, 2]
    for index, choice in choices.items():
        assert [c.is_terminal for c in choice].count(True) == 1 and choice[-1].is_terminal
        assert tokens_of(choice) == alone, index
    # One 39-token prefill (two chunks at a 32-token budget) and 11 decode steps, not three prefills.
    assert engine.stats.num_steps - steps_before <= 2 + 11 + 1
    await wait_for(lambda: engine.stats.kv_blocks_used == 0)
    engine.block_manager.check_integrity(engine.scheduler.requests())


async def test_seeded_choices_match_single_requests_seeded_in_turn(engine):
    prompt = list(range(5, 35))  # 30 tokens: the last KV block is partly filled and gets copied
    params = dict(max_tokens=16, temperature=1.0, top_k=50)
    singles = [tokens_of(await collect(engine, prompt, SamplingParams(**params, seed=10 + i))) for i in range(3)]
    choices = by_choice(await collect(engine, prompt, SamplingParams(**params, seed=10, n=3)))
    assert [tokens_of(choices[i]) for i in range(3)] == singles
    assert len({tuple(s) for s in singles}) > 1


async def test_n_choices_without_a_free_block_prefill_on_their_own(loaded):
    # 13 tokens in blocks of 4: the fourth block is partial and each fork needs a copy of it.
    tight = tiny_engine(loaded, num_kv_blocks=5, block_size=4, max_model_len=20)
    tight.start()
    try:
        prompt = list(range(1, 14))
        alone = tokens_of(await collect(tight, prompt, greedy(3)))
        choices = by_choice(await collect(tight, prompt, SamplingParams(max_tokens=3, temperature=0.0, n=3)))
        assert [tokens_of(choices[i]) for i in range(3)] == [alone] * 3
        await wait_for(lambda: tight.stats.kv_blocks_used == 0)
    finally:
        tight.shutdown()


async def test_stop_string_cuts_the_text_and_finishes_with_stop(engine):
    prompt = [20, 30, 40, 50]
    full = text_of(await collect(engine, prompt, greedy(40)))
    stop = full[15:18]
    cut = full[: full.index(stop)]
    chunks = await collect(engine, prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=(stop, "never")))
    assert text_of(chunks) == cut
    assert chunks[-1].finish_reason == FinishReason.STOP
    assert len(tokens_of(chunks)) < 40


async def test_stop_token_ends_the_output_without_its_text(engine):
    prompt = [7, 8, 9]
    full = tokens_of(await collect(engine, prompt, greedy(20)))
    stop_token = full[6]
    chunks = await collect(
        engine, prompt, SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=frozenset({stop_token}))
    )
    kept = full[: full.index(stop_token) + 1]
    assert tokens_of(chunks) == kept and chunks[-1].finish_reason == FinishReason.STOP
    assert text_of(chunks) == engine.token_bytes.join(kept[:-1]).decode(errors="replace")


async def test_stream_interval_groups_tokens_and_the_terminal_flushes(engine):
    params = SamplingParams(max_tokens=10, temperature=0.0, stream_interval=4)
    chunks, handed_over = await collect_handed_over(engine, [1, 2, 3], params)
    assert [len(c.token_ids) for c in handed_over] == [4, 4, 2]
    assert tokens_of(chunks) == tokens_of(await collect(engine, [1, 2, 3], greedy(10)))


async def test_logprobs_come_with_every_token(engine):
    chunks = await collect(engine, [4, 5, 6], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3))
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens_of(chunks)
    for lp in logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy: the sampled token is the best
        assert lp.logprob <= 0 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


async def test_terminal_chunk_carries_timings(engine):
    chunks = await collect(engine, list(range(1, 20)), greedy(8))
    timings = chunks[-1].timings
    assert all(c.timings is None for c in chunks[:-1])
    assert timings.prompt_tokens == 19 and timings.completion_tokens == 8
    assert 0 <= timings.queue_ms <= timings.ttft_ms and timings.decode_ms > 0
    assert timings.decode_tokens_per_second > 0


async def test_a_reader_that_stops_reading_pauses_its_request_only(loaded):
    engine = tiny_engine(loaded, max_unread_tokens=8)
    engine.start()
    try:
        expected = tokens_of(await collect(engine, [3, 1, 4], greedy(60)))
        stalled = StreamChannel(asyncio.get_running_loop())
        engine.submit("stalled", [3, 1, 4], greedy(60), stalled)
        await wait_for(lambda: engine.stats.num_paused == 1)
        # Others are served at full pace while it waits.
        assert len(tokens_of(await collect(engine, [2, 7], greedy(40)))) == 40
        assert stalled.unread_tokens == 8
        chunks = [c async for c in stalled]
        assert len(chunks[0].token_ids) == 8, "the backlog arrives as one coalesced chunk"
        assert tokens_of(chunks) == expected
    finally:
        engine.shutdown()


async def test_extreme_seeds_with_n_choices_do_not_break_the_step(engine):
    for seed in (2**64 - 1, -(2**63)):
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=seed, n=2)
        choices = by_choice(await collect(engine, [1, 2, 3], params))
        assert [c[-1].finish_reason for c in choices.values()] == [FinishReason.LENGTH] * 2


async def test_prefix_cache_hits_leave_outputs_exact(loaded):
    rng = random.Random(3)
    system = [rng.randrange(1, 500) for _ in range(21)]
    prompts = [system + [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))] for _ in range(10)]
    plain = tiny_engine(loaded, enable_prefix_caching=False)
    plain.start()
    try:
        expected = [tokens_of(await collect(plain, p, greedy(12))) for p in prompts]
        assert plain.stats.num_prefix_hit_tokens == 0
    finally:
        plain.shutdown()
    for overrides in ({}, {"num_kv_blocks": 40}):  # roomy, then tight enough to preempt and evict
        cached = tiny_engine(loaded, **overrides)
        cached.start()
        try:
            alone = [await collect(cached, p, greedy(12)) for p in prompts]
            together = await asyncio.gather(*[collect(cached, p, greedy(12)) for p in prompts])
            assert [tokens_of(c) for c in alone] == [tokens_of(c) for c in together] == expected
            # Every prompt after the first found the 20 system tokens (5 blocks of 4) cached.
            assert all(c[-1].timings.cached_tokens >= 20 for c in alone[1:])
            assert cached.stats.num_prefix_hit_tokens >= 20 * (2 * len(prompts) - 1)
            assert cached.stats.num_preemptions > 0 or "num_kv_blocks" not in overrides
            cached.block_manager.check_integrity(cached.scheduler.requests())
            await wait_for(lambda: cached.stats.kv_blocks_used == 0)
        finally:
            cached.shutdown()


async def test_a_kept_conversation_is_found_by_its_next_turn_until_unpinned_or_expired(loaded):
    engine = tiny_engine(loaded, pinned_kv_seconds=0.3, max_pinned_kv_fraction=0.5)
    engine.start()
    try:
        prompt = list(range(1, 30))
        first = await collect(engine, prompt, SamplingParams(max_tokens=8, temperature=0.0, keep_kv_as="a"))
        await wait_for(lambda: engine.stats.kv_blocks_pinned > 0)
        assert engine.stats.kv_blocks_used == engine.stats.kv_blocks_pinned
        follow_up = prompt + tokens_of(first) + [7, 7, 7]
        second = await collect(engine, follow_up, SamplingParams(max_tokens=4, temperature=0.0, continues="a"))
        # Every full block of the first turn came from its pin (block size 4).
        assert second[-1].timings.cached_tokens == (len(prompt) + len(tokens_of(first)) - 1) // 4 * 4
        engine.unpin("a")
        await wait_for(lambda: engine.stats.kv_blocks_pinned == 0)
        await collect(engine, prompt, SamplingParams(max_tokens=4, temperature=0.0, keep_kv_as="b"))
        await wait_for(lambda: engine.stats.kv_blocks_pinned > 0)
        # Unused for longer than its 0.3 s, the pin is let go (checked about once a second).
        await wait_for(lambda: engine.stats.kv_blocks_pinned == 0, timeout=5)
        assert engine.stats.kv_blocks_used == 0
        engine.block_manager.check_integrity([])
    finally:
        engine.shutdown()
