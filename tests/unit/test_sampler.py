import math

import torch

from engine.request import Request, SamplingParams
from engine.sampler import sample
from tests.unit.helpers import make_request


def request(output: tuple[int, ...] = (), **params) -> Request:
    made = make_request(prompt_len=1, params=SamplingParams(max_tokens=4, **params))
    made.token_ids.extend(output)
    return made


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
    logits = torch.randn(8, 50)
    expected = logits.argmax(-1).tolist()
    assert tokens([request(temperature=1.0, top_k=1, seed=i) for i in range(8)], logits) == expected
    assert tokens([request(temperature=1.0, top_p=1e-6, seed=i) for i in range(8)], logits) == expected
    assert tokens([request(temperature=1.0, min_p=0.999, seed=i) for i in range(8)], logits) == expected


def test_samples_follow_the_softmax_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    r = request(temperature=1.0, seed=0)
    counts = torch.zeros(3)
    for _ in range(4000):
        counts[tokens([r], logits)[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_top_k_never_picks_outside_the_k_best():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    r = request(temperature=2.0, top_k=2, seed=1)
    assert {tokens([r], logits)[0] for _ in range(300)} == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.2 keeps tokens at >= 0.1.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    r = request(temperature=1.0, min_p=0.2, seed=3)
    assert {tokens([r], logits)[0] for _ in range(400)} == {0, 1, 2}


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
