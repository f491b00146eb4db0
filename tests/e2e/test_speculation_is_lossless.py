"""Speculative decoding on the default model: greedy output identical to decoding without it."""

import asyncio
import json

import httpx
import pytest

from bench.speculative import EXTRACTIVE
from tests.e2e.conftest import serve

pytestmark = pytest.mark.slow

TOPICS = ["a dragon", "the sea", "bread", "a robot", "winter", "a city", "music", "trains", "a garden", "the moon"]
PROMPTS = [
    *EXTRACTIVE,
    *[f"Write two sentences about {topic}." for topic in TOPICS],
    *[f"List five facts about {topic}, one per line." for topic in TOPICS[:8]],
]


PROPOSERS = {
    "ngram": ["--speculative", "ngram"],
    "self-draft": ["--speculative", "draft", "--draft-model", "self:20", "--num-speculative-tokens", "2"],
}
# Decoding is batch-invariant by default, so the reference is the same on every server.
_reference: list[str] = []


@pytest.fixture(scope="module", params=list(PROPOSERS))
def speculative_server(request, default_model_path):
    yield from serve("--speculative-max-batch-size", "8", *PROPOSERS[request.param])


async def complete(client, base, prompt, speculative):
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 24,
        "temperature": 0,
        "speculative": speculative,
    }
    response = await client.post(f"{base}/v1/chat/completions", json=body)
    return response.json()


async def test_greedy_output_is_identical_with_and_without_speculation(speculative_server):
    assert len(PROMPTS) >= 20
    async with httpx.AsyncClient(timeout=300) as client:
        if not _reference:
            # In one batch: without speculation a request's output does not depend on its batch either.
            plain = await asyncio.gather(*[complete(client, speculative_server, p, False) for p in PROMPTS])
            _reference.extend(r["choices"][0]["message"]["content"] for r in plain)
        expected = _reference
        alone = [await complete(client, speculative_server, p, True) for p in PROMPTS]
        assert [r["choices"][0]["message"]["content"] for r in alone] == expected
        assert sum(r["timings"]["draft_n_accepted"] for r in alone) > 20
        for start in range(0, len(PROMPTS), 8):
            batch = PROMPTS[start : start + 8]
            together = await asyncio.gather(*[complete(client, speculative_server, p, True) for p in batch])
            assert [r["choices"][0]["message"]["content"] for r in together] == expected[start : start + 8]
    health = httpx.get(f"{speculative_server}/health").json()
    assert health["kv_blocks_used"] == 0 and health["num_accepted_tokens"] > 0


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


async def test_constrained_greedy_output_is_identical_with_and_without_speculation(speculative_server):
    """Proposals are cut at the first token the grammar forbids and every verified position is
    masked, so the grammar and speculation together give what the grammar alone gives."""

    async def constrained(client, prompt, speculative):
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 120,
            "temperature": 0,
            "speculative": speculative,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        }
        return (await client.post(f"{speculative_server}/v1/chat/completions", json=body)).json()

    # An example in the prompt gives the n-gram proposer something to find.
    example = '{"name":"Ann Lee","age":30,"hobbies":["reading","chess"]}'
    prompts = [
        f"Like {example}, describe {who} as JSON."
        for who in ("a baker", "a pilot", "a child", "a sailor", "a poet", "a nurse")
    ]
    async with httpx.AsyncClient(timeout=300) as client:
        without = [await constrained(client, p, False) for p in prompts]
        together = await asyncio.gather(*[constrained(client, p, True) for p in prompts])
    contents = [r["choices"][0]["message"]["content"] for r in without]
    assert [r["choices"][0]["message"]["content"] for r in together] == contents
    assert sum(r["timings"]["draft_n"] for r in together) > 0
    for response in without:
        assert response["choices"][0]["finish_reason"] == "stop", response
        assert set(json.loads(response["choices"][0]["message"]["content"])) == set(PERSON["properties"])
