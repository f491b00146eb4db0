"""The OpenAI SDK, unchanged, against a real server."""

import openai
import pytest

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture
def async_client(server):
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")


def test_models_lists_the_served_model(client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]


def test_chat_stream_and_non_stream_give_the_same_text(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content and text.strip()
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


async def test_async_chat_stream(async_client, model_name):
    stream = await async_client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices[0].delta.content) >= 2


async def test_async_completion(async_client, model_name):
    result = await async_client.completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert "Paris" in result.choices[0].text
    tokens = result.usage.completion_tokens
    assert 2 <= tokens <= 5 and result.choices[0].finish_reason == ("length" if tokens == 5 else "stop")


def test_completion_stream_matches_non_stream(client, model_name):
    kwargs = dict(model=model_name, prompt="def add(a, b):", max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs)
    text = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert text == full.choices[0].text


def test_seeded_sampling_is_reproducible(client, model_name):
    kwargs = dict(model=model_name, messages=MESSAGES, max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


def test_eos_ends_with_finish_reason_stop(client, model_name):
    result = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Reply with just the word yes."}],
        max_tokens=200,
        temperature=0,
    )
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens < 200


def test_bad_requests_get_openai_errors_and_the_server_stays_healthy(client, model_name, health):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=3)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=10**7)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert health()["status"] == "ok"
