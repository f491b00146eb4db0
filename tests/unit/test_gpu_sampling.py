"""The GPU's sampling kernel (engine/kernels/gpu/sampling.py): here on the CPU, through Triton's
interpreter, where CUDA is not (where it is, on the GPU).

Its draws come from the same uniforms as the CPU kernel's and torch's, so over rows of every
setting it must pick their tokens (bar the rare row where float rounding of a sum moves a
boundary); test_sampler.py checks those two against the target distributions. The nucleus
fallback, which the kernel does by bisection instead of a sort, is checked on its own."""

import asyncio

import pytest
import torch

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET: the kernel runs in Triton's interpreter.
pytest.importorskip("triton", reason="the GPU's sampling kernel is written in Triton")
pytestmark = pytest.mark.interpreter

from bench.sampler import SETTINGS  # noqa: E402
from engine.kernels.cpu.native import load_library  # noqa: E402
from engine.kernels.gpu import sampling as gpu_sampling  # noqa: E402
from engine.sampling.sampler import Sampler  # noqa: E402
from engine.tiny import tiny_engine, tiny_loaded  # noqa: E402
from engine.types import SamplingParams  # noqa: E402
from tests.conftest import CACHE_DIR  # noqa: E402
from tests.unit.helpers import collect, make_request  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def request(**params):
    return make_request(prompt_len=1, params=SamplingParams(max_tokens=4, **params))


def on_device(requests, logits) -> list[int]:
    return Sampler(device=gpu_sampling.sample_on_device).sample(requests, logits.to(DEVICE)).token_ids


def by_cpu(requests, logits) -> list[int]:
    """The CPU kernel's tokens, or torch's where the kernel cannot build."""
    return Sampler(load_library(CACHE_DIR)).sample(requests, logits).token_ids


def test_every_setting_draws_the_other_paths_tokens():
    """Greedy, temperature, top-k, top-p (by rejection), min-p and their mixes, seeded, over a
    vocabulary of whole blocks and a short last one, on peaked and nearly flat rows."""
    generator = torch.Generator().manual_seed(11)
    for vocab, rows in ((1000, 96), (49152, 12)):
        requests = [request(seed=i, **SETTINGS[i % len(SETTINGS)]) for i in range(rows)]
        logits = torch.randn(rows, vocab, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
        drawn = on_device(requests, logits)
        assert sum(a != b for a, b in zip(drawn, by_cpu(requests, logits))) <= 1
        assert sum(a != b for a, b in zip(drawn, Sampler().sample(requests, logits).token_ids)) <= 1


def test_edges_of_the_weights():
    """Forbidden tokens (-inf) are never drawn; min_p 1 keeps only the best at any temperature;
    top_k 1 is greedy; a row that forbids everything but one token draws it; greedy ties go to the
    lowest id."""
    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(4)) * 3
    logits[0, ::2] = float("-inf")
    logits[3, :] = float("-inf")
    logits[3, 517] = 0.0
    logits[4, [5, 300]] = 50.0
    requests = [
        request(temperature=1.5, top_p=0.95, seed=1),
        request(temperature=2.0, min_p=1.0, seed=2),
        request(temperature=1.0, top_k=1, seed=3),
        request(temperature=0.8, seed=4),
        request(temperature=0.0),
        request(temperature=1.0, top_k=2000, seed=6),
    ]
    drawn = on_device(requests, logits)
    assert drawn[0] % 2 == 1
    assert drawn[1:3] == logits[1:3].argmax(dim=-1).tolist()
    assert drawn[3] == 517
    assert drawn[4] == 5
    assert 0 <= drawn[5] < 700


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 1000, generator=generator)
    settings = [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9), dict(temperature=1.3, top_k=50, min_p=0.05)]
    for params in settings:
        alone = on_device([request(seed=42, **params)], logits)[0]
        batch = [request(seed=s, **settings[s % 3]) for s in range(7)] + [request(seed=42, **params)]
        assert on_device(batch, torch.cat([torch.randn(7, 1000, generator=generator), logits]))[-1] == alone


@pytest.mark.parametrize("rounds", [1, gpu_sampling.MAX_REJECTION_ROUNDS])
def test_the_nucleus_of_near_ties_is_the_best_token(monkeypatch, rounds):
    """Distinct weights within 1% of each other and top_p 1e-6: rejection drops about half a row a
    round, so rows reach the bisection for the nucleus's floor (every row with one round)."""
    monkeypatch.setattr(gpu_sampling, "MAX_REJECTION_ROUNDS", rounds)
    logits = torch.linspace(0.0, 0.01, 4096)[torch.randperm(4096, generator=torch.Generator().manual_seed(3))]
    requests = [request(temperature=1.0, top_p=1e-6, seed=i) for i in range(6)]
    assert on_device(requests, logits.repeat(6, 1)) == [int(logits.argmax())] * 6


def test_the_bisected_nucleus_keeps_the_right_tokens_in_proportion(monkeypatch):
    """With one rejection round most rows find their nucleus by bisection. 5 tiers of 8 tokens with
    masses 1/3, 4/15, 1/5, 2/15, 1/15: top_p 0.7 keeps tiers 0-2, drawn in proportion 5 : 4 : 3."""
    monkeypatch.setattr(gpu_sampling, "MAX_REJECTION_ROUNDS", 1)
    tiers = torch.arange(40) // 8
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])[tiers].log().repeat(300, 1)
    requests = [request(temperature=1.0, top_p=0.7, seed=i) for i in range(300)]
    counts = torch.zeros(5).index_add_(0, tiers[on_device(requests, logits)], torch.ones(300))
    assert counts[3:].sum() == 0
    expected = torch.tensor([5.0, 4.0, 3.0]) / 12 * 300
    # Chi-square with 2 degrees of freedom, at its 0.1% critical value.
    assert float(((counts[:3] - expected) ** 2 / expected).sum()) < 13.8


async def test_an_engine_sampling_on_the_device_gives_torch_s_tokens(default_tokenizer):
    """The engine's wiring: each row drawn at its request's position, the step's rows in one launch."""
    loaded = tiny_loaded(default_tokenizer, device=DEVICE)
    prompts = [[5, 9, 13], list(range(20, 60)), [7] * 15]
    settings = [dict(temperature=0.8, seed=1), dict(temperature=1.0, top_p=0.9, seed=2), dict(temperature=0.0)]

    async def tokens(device_kernel):
        engine = tiny_engine(loaded)
        engine.sampler = Sampler(device=gpu_sampling.sample_on_device if device_kernel else None)
        engine.start()
        try:
            params = [SamplingParams(max_tokens=12, ignore_eos=True, **s) for s in settings]
            results = await asyncio.gather(*[collect(engine, p, s) for p, s in zip(prompts, params)])
        finally:
            engine.shutdown()
        return [[t for chunk in chunks for t in chunk.token_ids] for chunks in results]

    assert await tokens(device_kernel=True) == await tokens(device_kernel=False)
