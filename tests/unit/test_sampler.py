import asyncio

import torch

from engine.channel import StreamChannel
from engine.detokenizer import IncrementalDetokenizer, TokenBytes
from engine.request import Request, SamplingParams
from engine.sampler import sample


def request(**params) -> Request:
    return Request(
        request_id="s",
        prompt_token_ids=[1],
        params=SamplingParams(max_tokens=4, **params),
        channel=StreamChannel(asyncio.new_event_loop()),
        detokenizer=IncrementalDetokenizer(TokenBytes([])),
    )


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert sample([request(temperature=0.0), request(temperature=0.0)], logits) == [1, 0]


def test_same_seed_same_tokens_whoever_shares_the_batch():
    logits = torch.randn(1, 100)
    alone = sample([request(temperature=1.0, seed=42)], logits)[0]
    batch_logits = torch.cat([torch.randn(1, 100), logits, torch.randn(1, 100)])
    batched = sample([request(temperature=1.0), request(temperature=1.0, seed=42), request(temperature=0.7)], batch_logits)
    assert batched[1] == alone


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(8, 50)
    expected = logits.argmax(-1).tolist()
    assert sample([request(temperature=1.0, top_k=1, seed=i) for i in range(8)], logits) == expected
    assert sample([request(temperature=1.0, top_p=1e-6, seed=i) for i in range(8)], logits) == expected


def test_samples_follow_the_softmax_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    r = request(temperature=1.0, seed=0)
    counts = torch.zeros(3)
    for _ in range(4000):
        counts[sample([r], logits)[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_top_k_never_picks_outside_the_k_best():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    r = request(temperature=2.0, top_k=2, seed=1)
    assert {sample([r], logits)[0] for _ in range(300)} == {0, 1}
