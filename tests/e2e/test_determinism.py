"""Deterministic by default: on the default server a request's tokens, and their logprobs, depend
on the request alone: not on what shares its batch, the prefix cache, chunking, speculation,
streaming or a resumed connection."""

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from app.sse_reader import iter_events, parse_events, read_events

pytestmark = pytest.mark.slow

SYSTEM = "You are a terse assistant. Answer in one or two short sentences, plainly, without lists."
QUESTIONS = [
    "What is 17 * 23?",
    "Why is the sky blue?",
    "Name a large city in Japan.",
    "What do bees make?",
    "Describe a river at night.",
    "How many legs does a spider have?",
]


def chat_body(question: str, system: bool = True, **params) -> dict:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    return {"messages": [*messages, {"role": "user", "content": question}], **params}


def choices_of(response: dict) -> dict[int, tuple]:
    return {
        c["index"]: (
            c["message"]["content"],
            c["finish_reason"],
            [(t["token"], t["logprob"]) for t in (c.get("logprobs") or {}).get("content") or []],
        )
        for c in response["choices"]
    }


def choices_of_stream(events) -> dict[int, tuple]:
    text: dict[int, str] = {}
    reasons: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    for event in events:
        if event.data == "[DONE]":
            break
        for choice in event.json()["choices"]:
            index = choice["index"]
            text[index] = text.get(index, "") + (choice["delta"].get("content") or "")
            reasons[index] = choice["finish_reason"] or reasons.get(index)
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs.setdefault(index, []).extend((t["token"], t["logprob"]) for t in content)
    return {index: (text[index], reasons[index], logprobs.get(index, [])) for index in text}


async def complete(client: httpx.AsyncClient, base: str, body: dict) -> dict[int, tuple]:
    response = await client.post(f"{base}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return choices_of(response.json())


async def stream(client: httpx.AsyncClient, base: str, body: dict, slow: bool = False) -> dict[int, tuple]:
    lines = []
    async with client.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            lines.append(line)
            if slow and len(lines) < 60:
                # A reader this slow falls behind --max-unread-tokens and gets its stream paused.
                await asyncio.sleep(0.05)
    return choices_of_stream(parse_events(lines))


async def test_greedy_logprobs_are_the_same_alone_in_a_crowd_and_from_the_prefix_cache(server):
    body = chat_body("Describe a lighthouse keeper's morning.", max_tokens=40, temperature=0, logprobs=True)
    others = [chat_body(q, max_tokens=40, temperature=0) for q in QUESTIONS]
    async with httpx.AsyncClient(timeout=300) as client:
        first = await complete(client, server, body)
        # Now its prompt is in the prefix cache: computed from a cache hit, not from scratch.
        again = await complete(client, server, body)
        crowd = await asyncio.gather(
            *[complete(client, server, other) for other in others[:3]],
            stream(client, server, body),
            *[complete(client, server, other) for other in others[3:]],
        )
    assert len(first[0][2]) == 40
    assert again == first
    assert crowd[3] == first


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_streamed_non_streamed_and_resumed_are_the_same_bytes(server, sampling):
    body = chat_body("Tell a two-sentence story about a fox.", max_tokens=48, logprobs=True, **sampling)
    whole = choices_of(httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120).json())
    streamed = choices_of_stream(
        read_events(httpx.post(f"{server}/v1/chat/completions", json={**body, "stream": True}, timeout=120))
    )
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", json={**body, "stream": True, "resumable": True}, timeout=120
    ) as response:
        first = []
        for event in iter_events(response.iter_lines()):
            first.append(event)
            if len(first) == 5:
                break
    with httpx.stream(
        "GET", f"{server}/v1/streams/{first[0].json()['id']}", headers={"Last-Event-ID": first[-1].id}, timeout=120
    ) as response:
        rest = read_events(response)
    assert streamed == whole
    assert choices_of_stream(first + rest) == whole


_request = st.fixed_dictionaries(
    {
        "question": st.sampled_from(QUESTIONS),
        "system": st.booleans(),
        "max_tokens": st.integers(4, 40),
        "stop": st.sampled_from([None, ["."], [" the"], ["\n"]]),
        "n": st.sampled_from([1, 1, 2]),
        "seed": st.one_of(st.none(), st.integers(0, 5)),
        "speculative": st.booleans(),
        "slow": st.booleans(),
        "streamed": st.booleans(),
    }
)


def _body(spec: dict) -> dict:
    sampling = {"temperature": 0} if spec["seed"] is None else {"temperature": 1.0, "seed": spec["seed"]}
    # Seeded requests sample without speculation: rejection sampling spends the random draws
    # differently, so its samples follow the same distribution but are other samples.
    speculative = spec["speculative"] and spec["seed"] is None
    return chat_body(
        spec["question"],
        spec["system"],
        max_tokens=spec["max_tokens"],
        stop=spec["stop"],
        n=spec["n"],
        speculative=speculative,
        **sampling,
    )


_alone: dict[str, dict] = {}


# No shrinking: each example costs seconds of generation, and the failing mix is printed whole. For
# that cost, a quarter of the profile's examples: 15 in CI, 6 elsewhere.
@settings(
    max_examples=settings().max_examples // 4,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)
@given(specs=st.lists(_request, min_size=2, max_size=7))
def test_every_request_in_a_random_mix_gets_what_it_gets_alone(ngram_server, specs):
    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            for spec in specs:
                key = json.dumps(_body(spec), sort_keys=True)
                if key not in _alone:
                    _alone[key] = await complete(client, ngram_server, _body(spec))
            return await asyncio.gather(
                *[
                    stream(client, ngram_server, _body(spec), spec["slow"])
                    if spec["streamed"]
                    else complete(client, ngram_server, _body(spec))
                    for spec in specs
                ]
            )

    together = asyncio.run(run())
    for spec, got in zip(specs, together):
        assert got == _alone[json.dumps(_body(spec), sort_keys=True)], spec
    health = httpx.get(f"{ngram_server}/health").json()
    assert health["num_running"] == 0 and health["kv_blocks_used"] == 0
