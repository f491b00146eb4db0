import math

import pytest
import torch

# Every sampling path at once, for the tests that compare two ways of drawing the same rows.
from bench.sampler import SETTINGS
from engine.kernels.cpu.native import load_library
from engine.request import Request
from engine.sampling.sampler import BLOCK, Sampler
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import make_request

# Every test runs on both of the sampler's paths: torch's, and the CPU kernel's.
_sampler = Sampler()


@pytest.fixture(autouse=True, params=["torch", "kernel"])
def sampler_path(request):
    global _sampler
    _sampler = Sampler(_kernels() if request.param == "kernel" else None)
    yield request.param
    _sampler = Sampler()


def _kernels():
    """The CPU kernels' library; the test skips where they cannot run."""
    library = load_library(CACHE_DIR)
    if library is None:
        pytest.skip("Sluice's CPU kernels cannot run here")
    return library


def request(output: tuple[int, ...] = (), **params) -> Request:
    made = make_request(prompt_len=1, params=SamplingParams(max_tokens=4, **params))
    made.token_ids.extend(output)
    return made


def sample(requests: list[Request], logits: torch.Tensor):
    return _sampler.sample(requests, logits)


def tokens(requests: list[Request], logits: torch.Tensor) -> list[int]:
    return sample(requests, logits).token_ids


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert tokens([request(temperature=0.0), request(temperature=0.0)], logits) == [1, 0]


def test_same_seed_same_tokens_whoever_shares_the_batch():
    logits = torch.randn(1, 100)
    alone = tokens([request(temperature=1.0, seed=42)], logits)[0]
    batch_logits = torch.cat([torch.randn(1, 100), logits, torch.randn(1, 100)])
    batched = tokens(
        [request(temperature=1.0), request(temperature=1.0, seed=42), request(temperature=0.7)], batch_logits
    )
    assert batched[1] == alone


def test_top_k_one_and_tiny_top_p_are_greedy():
    # Seeded: a random runner-up within 0.1% of the best would pass min_p 0.999 by a rounding of exp.
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    expected = logits.argmax(-1).tolist()
    assert tokens([request(temperature=1.0, top_k=1, seed=i) for i in range(8)], logits) == expected
    assert tokens([request(temperature=1.0, top_p=1e-6, seed=i) for i in range(8)], logits) == expected
    assert tokens([request(temperature=1.0, min_p=0.999, seed=i) for i in range(8)], logits) == expected


def frequencies(params: dict, logits: torch.Tensor, trials: int = 4000) -> torch.Tensor:
    """Token counts over `trials` draws of one row, each with a fresh key (a draw is a function
    of the request's key and position, so repeating one request repeats its token)."""
    r = request(**params)
    keys = list(range(trials))
    counts = torch.zeros(logits.shape[1])
    for key in keys:
        r.rng_key = key
        counts[tokens([r], logits)[0]] += 1
    return counts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 0.1% critical values of chi-square by degrees of freedom.
CRITICAL = {2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5}


def test_samples_follow_the_tempered_softmax():
    logits = torch.log(torch.tensor([[0.35, 0.25, 0.2, 0.1, 0.06, 0.04]]))
    expected = (logits[0] / 0.7).softmax(-1)
    assert chi_square(frequencies(dict(temperature=0.7), logits), expected) < CRITICAL[5]


def test_top_k_keeps_the_k_best_renormalized():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.05, 0.25, 0.2]]))
    expected = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.2]) / 0.85
    assert chi_square(frequencies(dict(temperature=1.0, top_k=3), logits), expected) < CRITICAL[2]


def test_top_k_over_many_blocks_keeps_the_k_best_renormalized():
    # 1,024 tokens in 4 blocks of 256, k no more than the blocks (the kernel looks for the k-th
    # largest among the blocks' maxima first): two of the best three sharing a block, the fourth
    # best heading a block of its own; then the best three each heading a block.
    for best in ([3, 10, 600, 900], [3, 300, 600, 700]):
        logits = torch.full((1, 1024), -12.0)
        logits[0, best] = torch.log(torch.tensor([0.4, 0.25, 0.2, 0.1]))
        counts = frequencies(dict(temperature=1.0, top_k=3), logits)
        assert counts.sum() == counts[best[:3]].sum()
        assert chi_square(counts[best[:3]], torch.tensor([0.4, 0.25, 0.2]) / 0.85) < CRITICAL[2]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # Sorted 0.4, 0.25, 0.2, 0.1, 0.05: mass before 0.1 is 0.85 >= 0.8, so 0.1 and 0.05 go.
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.05, 0.25, 0.2]]))
    expected = torch.tensor([0.0, 0.4, 0.0, 0.25, 0.2]) / 0.85
    assert chi_square(frequencies(dict(temperature=1.0, top_p=0.8), logits), expected) < CRITICAL[2]


def test_top_p_on_a_flat_distribution_past_the_candidates_is_exact():
    # 1,000 tokens in 5 tiers: the candidates (the best 64) cannot reach 0.7 of the mass, so the
    # nucleus is found by rejection; tiers, not tokens, are counted.
    tiers = torch.arange(1000) // 200
    weights = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])[tiers]
    logits = weights.log().unsqueeze(0)
    probs = weights / weights.sum()
    # Tier masses 1/3, 4/15, 1/5, 2/15, 1/15: top_p 0.7 keeps tiers 0-2 (mass before tier 2 is 0.6).
    expected = torch.tensor([5.0, 4.0, 3.0]) / 12
    counts = frequencies(dict(temperature=1.0, top_p=0.7), logits, trials=3000)
    by_tier = torch.zeros(5).index_add_(0, tiers, counts)
    assert by_tier[3:].sum() == 0
    assert chi_square(by_tier[:3], expected) < CRITICAL[2]
    assert probs[tiers < 3].sum() > 0.7


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps tokens at >= 0.1.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert chi_square(frequencies(dict(temperature=1.0, min_p=0.2), logits), expected) < CRITICAL[2]


def test_a_draw_over_a_vocabulary_of_partial_blocks_is_exact():
    # 700 tokens: two full blocks of 256 and a short one; mass spread over all three.
    probs = torch.rand(700, generator=torch.Generator().manual_seed(0)) ** 4
    probs /= probs.sum()
    blocks = torch.arange(700) // BLOCK
    counts = torch.zeros(3).index_add_(0, blocks, frequencies(dict(temperature=1.0), probs.log()[None], 3000))
    assert chi_square(counts, torch.zeros(3).index_add_(0, blocks, probs)) < CRITICAL[2]


def test_seeded_draws_are_the_same_in_any_batch():
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(1))
    settings = [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9), dict(temperature=1.3, top_k=50, min_p=0.05)]
    for params in settings:
        alone = tokens([request(seed=42, **params)], logits)[0]
        others = torch.randn(63, 49152)
        batch = [request(seed=s, **settings[s % 3]) for s in range(63)] + [request(seed=42, **params)]
        assert tokens(batch, torch.cat([others, logits]))[-1] == alone


def test_logit_bias_can_force_or_forbid_a_token():
    logits = torch.tensor([[5.0, 0.0, 1.0]])
    assert tokens([request(temperature=0.0, logit_bias=((1, 100.0),))], logits) == [1]
    assert tokens([request(temperature=0.0, logit_bias=((0, -100.0),))], logits) == [2]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    assert tokens([request(output=(0,), temperature=0.0, presence_penalty=1.0)], logits) == [1]
    assert tokens([request(output=(0,), temperature=0.0, presence_penalty=0.4)], logits) == [0]
    # Two earlier 0s at 0.3 each outweigh the 0.5 lead.
    assert tokens([request(output=(0, 0), temperature=0.0, frequency_penalty=0.3)], logits) == [1]
    # The prompt (token 1) is not output: presence leaves token 1 alone.
    assert tokens([request(temperature=0.0, presence_penalty=2.0)], torch.tensor([[0.0, 3.0, 2.5]])) == [1]


def test_repetition_penalty_covers_prompt_and_output():
    # Token 1 is the prompt: divided by 2 it falls below token 2.
    logits = torch.tensor([[0.0, 3.0, 2.0]])
    assert tokens([request(temperature=0.0, repetition_penalty=2.0)], logits) == [2]
    # A negative logit is multiplied, so it drops further.
    logits = torch.tensor([[-1.0, -0.5, -0.8]])
    assert tokens([request(temperature=0.0, repetition_penalty=2.0)], logits) == [2]


def test_penalties_leave_the_logits_untouched_for_logprobs():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    output = sample([request(output=(0,), temperature=0.0, presence_penalty=1.0, logprobs=0)], logits)
    expected = torch.log_softmax(torch.tensor([3.0, 2.5, 0.0]), dim=-1)[1].item()
    assert output.token_ids == [1] and math.isclose(output.logprobs[0].logprob, expected, rel_tol=1e-5)


def test_logprobs_report_the_sampled_token_and_the_top_k():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]))
    output = sample([request(temperature=0.0, logprobs=2), request(temperature=0.0)], logits)
    first, second = output.logprobs
    assert second is None
    assert first.token_id == 1 and math.isclose(first.logprob, math.log(0.6), rel_tol=1e-5)
    assert [t for t, _ in first.top] == [1, 2]
    assert math.isclose(first.top[1][1], math.log(0.3), rel_tol=1e-5)


def test_min_p_one_keeps_only_the_best_token_at_any_temperature():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(5)) * 3
    for temperature in (0.3, 1.5, 2.0):
        requests = [request(temperature=temperature, min_p=1.0, seed=i) for i in range(16)]
        assert tokens(requests, logits) == logits.argmax(-1).tolist()


def test_a_nucleus_of_one_among_many_near_ties_takes_the_best():
    # 49,152 distinct weights within 1% of each other and top_p 1e-6: each rejection round drops
    # about half the row, so many rows reach the sorted fallback after 16 rounds.
    logits = torch.linspace(0.0, 0.01, 49152)[torch.randperm(49152, generator=torch.Generator().manual_seed(3))]
    rows = logits.repeat(8, 1)
    requests = [request(temperature=1.0, top_p=1e-6, seed=i) for i in range(8)]
    assert tokens(requests, rows) == [int(logits.argmax())] * 8


def test_masked_tokens_are_never_drawn():
    logits = torch.zeros(4, 1001)
    logits[:, ::2] = -math.inf
    for temperature in (0.5, 1.0, 3.0):
        for seed in range(20):
            requests = [request(temperature=temperature, top_p=0.95, seed=seed * 4 + i) for i in range(4)]
            assert all(t % 2 == 1 for t in tokens(requests, logits))


def test_the_kernel_and_torch_draw_the_same_tokens():
    """Both paths take the same uniforms the same way: over many rows of mixed settings their
    tokens agree, bar the rare row where float rounding of a sum moves a boundary."""
    library = _kernels()
    generator = torch.Generator().manual_seed(11)
    requests = [request(seed=i, **SETTINGS[i % len(SETTINGS)]) for i in range(192)]
    logits = torch.randn(192, 49152, generator=generator) * torch.rand(192, 1, generator=generator) * 4
    by_torch = Sampler().sample(requests, logits).token_ids
    by_kernel = Sampler(library).sample(requests, logits).token_ids
    assert sum(a != b for a, b in zip(by_torch, by_kernel)) <= 2


def _head_and_block_max(library, rows: int, vocab: int, generator: torch.Generator):
    """Logits from the kernel's output head, with its block maxima; integer weights and inputs make
    ties for the max, within and across blocks."""
    from engine.kernels.cpu.invariant import PackedLinear

    head = PackedLinear.pack(library, torch.randint(-3, 4, (vocab, 8), generator=generator).float())
    return head.with_block_max(torch.randint(-2, 3, (rows, 8), generator=generator).float())


def test_the_heads_block_maxima_change_no_token():
    """Given the output head's block maxima the kernel skips its max pass and reads only the
    block holding a greedy row's max; the tokens are the ones it draws without them."""
    library = _kernels()
    generator = torch.Generator().manual_seed(5)
    for vocab in (1000, 49152):
        logits, block_max = _head_and_block_max(library, 60, vocab, generator)
        requests = [request(seed=i, **SETTINGS[i % len(SETTINGS)]) for i in range(60)]
        with_maxima = Sampler(library).sample(requests, logits, block_max=block_max).token_ids
        assert with_maxima == Sampler(library).sample(requests, logits).token_ids
        greedy = [i for i, r in enumerate(requests) if r.params.greedy]
        assert [with_maxima[i] for i in greedy] == logits[greedy].argmax(dim=-1).tolist()


def test_rows_that_penalties_or_a_grammar_changed_ignore_the_heads_block_maxima():
    from engine.sampling.masks import RowMask

    library = _kernels()
    logits, block_max = _head_and_block_max(library, 2, 1000, torch.Generator().manual_seed(6))
    best = logits.argmax(dim=-1).tolist()
    # A bias makes another token the best; a grammar forbids the best and token 0 (which a row whose
    # weights all underflowed against the stale max would fall back to).
    biased = request(temperature=0.0, logit_bias=((best[0] + 1, 100.0),))
    allowed = torch.ones(1, 1000, dtype=torch.bool)
    allowed[0, [0, best[1]]] = False
    constrained = request(temperature=0.01, seed=3)
    token_ids = (
        Sampler(library).sample([biased, constrained], logits, RowMask([1], allowed), block_max=block_max).token_ids
    )
    assert token_ids[0] == best[0] + 1
    assert allowed[0, token_ids[1]]
