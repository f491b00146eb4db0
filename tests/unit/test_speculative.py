import asyncio
import dataclasses
import random

import pytest
import torch

from engine.channel import StreamChannel
from engine.config import SpeculativeConfig
from engine.sampling.speculative import NgramProposer, Proposal, verify
from engine.tiny import tiny_engine, tiny_loaded
from engine.types import FinishReason, SamplingParams
from tests.unit.helpers import collect, collect_handed_over, make_request, tokens_of

NGRAM = SpeculativeConfig("ngram", num_tokens=4, max_batch_size=16)
DRAFT = SpeculativeConfig("draft", num_tokens=3, max_batch_size=16)
# The repetitive tiny model keeps repeating this token, so n-gram proposals are accepted.
REPEATING = [378] * 8


@pytest.fixture(scope="module")
def loaded(default_tokenizer):
    return tiny_loaded(default_tokenizer, repetitive=True)


def speculative_engine(loaded, method: str, **overrides):
    if method == "ngram":
        return tiny_engine(loaded, speculative=NGRAM, **overrides)
    return tiny_engine(loaded, draft_model=loaded.model.first_layers(1), speculative=DRAFT, **overrides)


@pytest.fixture(scope="module", params=["ngram", "draft"])
def engines(loaded, request):
    plain, speculative = tiny_engine(loaded), speculative_engine(loaded, request.param)
    plain.start()
    speculative.start()
    yield plain, speculative
    plain.shutdown()
    speculative.shutdown()


def greedy(n, **extra):
    return SamplingParams(max_tokens=n, temperature=0.0, **extra)


def prompts(count=24, seed=0):
    rng = random.Random(seed)
    result = []
    for i in range(count):
        # Half repeat a phrase, as extractive prompts do; half are random.
        phrase = [rng.randrange(1, 500) for _ in range(rng.randint(2, 6))]
        result.append(
            phrase * rng.randint(2, 5) if i % 2 else [rng.randrange(1, 500) for _ in range(rng.randint(3, 40))]
        )
    return result


def text_of(chunks):
    return "".join(c.text for c in chunks)


# Proposer.


def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    request = make_request(1)
    request.token_ids[:] = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert proposer.propose([request], [3])[0].token_ids == [8, 9, 1]
    request.token_ids[:] = [1, 2, 3, 4]
    assert proposer.propose([request], [3])[0].token_ids == []
    # The longest suffix wins over a more recent shorter match.
    request.token_ids[:] = [1, 2, 3, 50, 9, 3, 60, 2, 3]
    assert proposer.propose([request], [2])[0].token_ids == [50, 9]


# Verifier: the output follows the target distribution whatever is proposed.


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 0.1% critical value of chi-square with 5 degrees of freedom (6 tokens).
CRITICAL = 20.5
TARGET = torch.tensor([[0.05, 0.40, 0.20, 0.10, 0.15, 0.10], [0.30, 0.05, 0.05, 0.30, 0.20, 0.10]])


@pytest.mark.parametrize("draft", ["point mass", "sampled draft"])
def test_rejection_sampling_follows_the_target_distribution(draft):
    request = make_request(1, params=SamplingParams(max_tokens=8, temperature=1.0, seed=1234))
    logits = TARGET.log()
    q = torch.tensor([0.50, 0.10, 0.10, 0.10, 0.10, 0.10])
    proposal_rng = torch.Generator().manual_seed(99)
    first, second = torch.zeros(6), torch.zeros(6)
    for i in range(8000):
        # A fresh key per trial: draws are keyed by (request, position), and both stay put here.
        request.rng_key = i
        if draft == "point mass":
            proposal = Proposal([0])  # token 0 is unlikely under the target: mostly rejected
        else:
            token = int(torch.multinomial(q, 1, generator=proposal_rng))
            proposal = Proposal([token], q[None])
        tokens = verify([request], [proposal], torch.cat([logits[:1], logits[1:]]))[0].token_ids
        first[tokens[0]] += 1
        if len(tokens) == 2:
            second[tokens[1]] += 1
    assert chi_square(first, TARGET[0]) < CRITICAL
    assert chi_square(second, TARGET[1]) < CRITICAL


def test_a_verifier_that_always_accepts_would_fail_the_check():
    counts = torch.zeros(6)
    counts[0] = 8000  # what accepting every point-mass proposal of token 0 gives
    assert chi_square(counts, TARGET[0]) > CRITICAL


def test_greedy_verification_keeps_the_matching_prefix_plus_one():
    request = make_request(1, params=greedy(8))
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 9, 7]):
        logits[row, best] = 5.0
    result = verify([request], [Proposal([3, 4, 5])], logits)[0]
    assert result.token_ids == [3, 4, 9] and result.num_accepted == 2
    result = verify([request], [Proposal([3, 4, 9])], logits)[0]
    assert result.token_ids == [3, 4, 9, 7] and result.num_accepted == 3


# Engine: speculation changes nothing but speed.


async def test_greedy_output_is_identical_alone_and_eight_at_a_time(engines):
    plain, speculative = engines
    cases = prompts()
    expected = [tokens_of(await collect(plain, p, greedy(32))) for p in cases]
    alone = [tokens_of(await collect(speculative, p, greedy(32))) for p in cases]
    assert alone == expected
    for start in range(0, len(cases), 8):
        batch = cases[start : start + 8]
        together = await asyncio.gather(*[collect(speculative, p, greedy(32)) for p in batch])
        assert [tokens_of(c) for c in together] == expected[start : start + 8]
    stats = speculative.stats
    assert stats.num_accepted_tokens > 100, "the test must exercise accepted proposals"
    assert stats.num_draft_tokens > stats.num_accepted_tokens, "and rejected ones"


async def test_per_request_opt_out_skips_speculation(engines):
    _, speculative = engines
    before = speculative.stats.num_draft_tokens
    chunks = await collect(speculative, [7, 8] * 8, greedy(20, speculative=False))
    assert speculative.stats.num_draft_tokens == before
    assert chunks[-1].timings.draft_tokens == 0


async def test_bursts_go_out_as_one_chunk_and_timings_count_proposals(engines):
    _, speculative = engines
    chunks, handed_over = await collect_handed_over(speculative, REPEATING, greedy(40))
    assert max(len(c.token_ids) for c in handed_over) > 1
    timings = chunks[-1].timings
    assert timings.draft_tokens >= timings.accepted_tokens > 0


async def test_max_tokens_stop_string_and_eos_inside_a_burst(loaded, engines):
    plain, speculative = engines
    for prompt in prompts(12, seed=3):
        reference = await collect(plain, prompt, greedy(40))
        full = text_of(reference)
        for n in (1, 5, 13):
            assert tokens_of(await collect(speculative, prompt, greedy(n))) == tokens_of(reference)[:n]
        if len(full) > 12:
            stop = full[8:11]
            params = greedy(40, stop=(stop,))
            want, got = await collect(plain, prompt, params), await collect(speculative, prompt, params)
            assert (text_of(got), tokens_of(got)) == (text_of(want), tokens_of(want))
            assert got[-1].finish_reason == FinishReason.STOP
            # A stop string and max_tokens inside one burst: the stop string came first.
            for n in range(len(tokens_of(want)), len(tokens_of(want)) + 4):
                params = greedy(n, stop=(stop,))
                want, got = await collect(plain, prompt, params), await collect(speculative, prompt, params)
                assert (tokens_of(got), got[-1].finish_reason) == (tokens_of(want), want[-1].finish_reason)
    # eos inside a burst: make eos a token that came out second in a burst of three or more.
    for prompt in prompts(12, seed=3):
        chunks = await collect(speculative, prompt, greedy(40))
        output = tokens_of(chunks)
        bursts = [c.token_ids for c in chunks if len(c.token_ids) >= 3 and c.token_ids[1] not in output[:3]]
        if bursts:
            eos = bursts[0][1]
            break
    else:
        pytest.fail("no burst of three tokens to put an eos in")
    with_eos = dataclasses.replace(loaded, eos_token_ids=frozenset({eos}))
    eos_plain, eos_speculative = tiny_engine(with_eos), speculative_engine(with_eos, "ngram")
    eos_plain.start()
    eos_speculative.start()
    try:
        want = await collect(eos_plain, prompt, greedy(40))
        got = await collect(eos_speculative, prompt, greedy(40))
        assert tokens_of(got) == tokens_of(want) and tokens_of(got)[-1] == eos
        assert got[-1].finish_reason == FinishReason.STOP
    finally:
        eos_plain.shutdown()
        eos_speculative.shutdown()


async def test_cancel_during_speculation_frees_everything(engines):
    _, speculative = engines
    channel = StreamChannel(asyncio.get_running_loop())
    speculative.submit("c", REPEATING, greedy(500), channel)
    async for chunk in channel:
        if len(chunk.token_ids) > 1:
            break
    channel.cancel()
    rest = [c async for c in channel]
    assert rest[-1].finish_reason == FinishReason.CANCELLED
    deadline = asyncio.get_running_loop().time() + 10
    while speculative.stats.kv_blocks_used and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    assert speculative.stats.kv_blocks_used == 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_kv_accounting_holds_over_thousands_of_speculative_steps(loaded, method):
    engine = speculative_engine(loaded, method, num_kv_blocks=160, block_size=4)
    engine.start()
    try:
        params = [
            SamplingParams(max_tokens=120, temperature=t, seed=i, top_k=20) for i, t in enumerate([0.0, 0.5, 1.0] * 6)
        ]
        cases = prompts(18, seed=5)
        results = await asyncio.gather(*[collect(engine, p, sp) for p, sp in zip(cases, params)])
        assert all(len(tokens_of(r)) == 120 for r in results)
        assert engine.stats.num_draft_tokens > 1000
        while engine.stats.kv_blocks_used:
            await asyncio.sleep(0.01)
        engine.block_manager.check_integrity(engine.scheduler.requests())
    finally:
        engine.shutdown()
