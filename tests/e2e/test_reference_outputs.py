"""The default model's greedy tokens and logprobs on a fixed prompt set, bit for bit against a reference
recorded with the float32 batch-invariant kernels (reference_outputs.json): however the weights are stored
and whichever kernel variant reads them, and alone, batched, chunked or from the prefix cache."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.model.loader import LoadedModel, load_model
from engine.tiny import tiny_engine
from engine.types import SamplingParams
from tests.conftest import CACHE_DIR
from tests.unit.helpers import collect

pytestmark = pytest.mark.slow

REFERENCE = Path(__file__).parent / "reference_outputs.json"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is 17 times 23?\nA:",
    "Photosynthesis is the process by which",
]
MAX_TOKENS = 16


async def submit(engine: Engine, prompts: list[list[int]]) -> list[list[list]]:
    """Each prompt's tokens, each with its logprob and the top 3 alternatives' (as float.hex, exact), all
    prompts submitted at once."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    results = await asyncio.gather(*[collect(engine, p, params) for p in prompts])
    return [
        [
            [lp.token_id, lp.logprob.hex(), [[t, v.hex()] for t, v in lp.top]]
            for chunk in chunks
            for lp in chunk.logprobs or []
        ]
        for chunks in results
    ]


async def greedy(loaded: LoadedModel, prompts: list[list[int]], **config) -> list[list[list]]:
    engine = tiny_engine(loaded, **config)
    engine.start()
    try:
        return await submit(engine, prompts)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    loaded = load_model(None, CACHE_DIR, device="cpu", dtype="auto", batch_invariant=True)
    assert loaded.model.batch_invariant
    return loaded


def prompt_ids(loaded: LoadedModel) -> list[list[int]]:
    return [loaded.tokenizer(text)["input_ids"] for text in PROMPTS]


async def test_greedy_tokens_and_logprobs_are_the_recorded_ones_alone_batched_chunked_and_cached(loaded):
    reference = json.loads(REFERENCE.read_text())
    prompts = prompt_ids(loaded)
    assert [len(r) for r in reference] == [MAX_TOKENS] * len(PROMPTS)
    alone = [(await greedy(loaded, [p]))[0] for p in prompts]
    assert alone == reference
    assert await greedy(loaded, prompts) == reference
    assert await greedy(loaded, prompts, max_num_batched_tokens=5) == reference
    # One engine twice: the second pass reads the prompts' full blocks from the prefix cache.
    engine = tiny_engine(loaded)
    engine.start()
    try:
        assert await submit(engine, prompts) == reference
        assert await submit(engine, prompts[::-1]) == reference[::-1]
        assert engine.block_manager.num_prefix_hits > 0
    finally:
        engine.shutdown()
