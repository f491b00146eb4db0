"""The OpenAI SDK, unchanged, against a real server."""

import openai
import pytest
from pydantic import BaseModel

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


# The SDK's helpers parse what they receive into typed objects and check it as they go: structured output
# into a pydantic model, streams into typed events with snapshots, the Responses stream by its sequence.
class Color(BaseModel):
    name: str
    hex: str


class GetWeather(BaseModel):
    city: str


JSON_MESSAGES = [{"role": "user", "content": "Name a color as JSON."}]
YES = [{"role": "user", "content": "Reply with just the word yes."}]


def test_chat_parse_fills_a_pydantic_model(client, model_name):
    result = client.chat.completions.parse(
        model=model_name, messages=JSON_MESSAGES, response_format=Color, max_tokens=60, temperature=0
    )
    message = result.choices[0].message
    assert isinstance(message.parsed, Color) and message.parsed == Color.model_validate_json(message.content)


def test_chat_stream_helper_events_add_up_to_the_final_completion(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=YES, max_tokens=50, temperature=0)
    with client.chat.completions.stream(model=model_name, messages=YES, max_tokens=50, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [e for e in events if e.type == "content.delta"]
    assert deltas and "".join(e.delta for e in deltas) == deltas[-1].snapshot == full.choices[0].message.content
    assert [e.content for e in events if e.type == "content.done"] == [full.choices[0].message.content]
    assert final.choices[0].message.content == full.choices[0].message.content
    assert final.choices[0].finish_reason == "stop" and final.usage is None


def test_chat_stream_helper_streams_a_tool_call(client, model_name):
    tools = [openai.pydantic_function_tool(GetWeather)]
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    with client.chat.completions.stream(
        model=model_name, messages=messages, tools=tools, tool_choice="required", max_tokens=40, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    [done] = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    [call] = final.choices[0].message.tool_calls
    assert {e.name for e in deltas} == {done.name} == {call.function.name} == {"GetWeather"}
    assert "".join(e.arguments_delta for e in deltas) == done.arguments == call.function.arguments
    assert isinstance(done.parsed_arguments, GetWeather) and call.function.parsed_arguments == done.parsed_arguments
    assert final.choices[0].finish_reason == "tool_calls"


def test_responses_parse_fills_a_pydantic_model(client, model_name):
    result = client.responses.parse(
        model=model_name, input="Name a color as JSON.", text_format=Color, max_output_tokens=60, temperature=0
    )
    assert isinstance(result.output_parsed, Color) and result.output_parsed == Color.model_validate_json(
        result.output_text
    )


def test_responses_stream_helper_sees_the_whole_event_sequence(client, model_name):
    with client.responses.stream(
        model=model_name, input="Reply with just the word yes.", max_output_tokens=50, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in (
        "output_item.added",
        "content_part.added",
        "output_text.done",
        "content_part.done",
        "output_item.done",
    ):
        assert types.count(f"response.{kind}") == 1, kind
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text and final.status == "completed"
    assert final.id == events[0].response.id


async def test_async_client_helpers(async_client, model_name):
    parsed = await async_client.chat.completions.parse(
        model=model_name, messages=JSON_MESSAGES, response_format=Color, max_tokens=60, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, Color)
    async with async_client.chat.completions.stream(model=model_name, messages=YES, max_tokens=50, temperature=0) as s:
        deltas = [e.delta async for e in s if e.type == "content.delta"]
        final = await s.get_final_completion()
    assert deltas and "".join(deltas) == final.choices[0].message.content
    response = await async_client.responses.parse(
        model=model_name, input="Name a color as JSON.", text_format=Color, max_output_tokens=60, temperature=0
    )
    assert isinstance(response.output_parsed, Color)
    async with async_client.responses.stream(
        model=model_name, input="Reply with just the word yes.", max_output_tokens=50, temperature=0
    ) as s:
        events = [e async for e in s]
        final_response = await s.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final_response.output_text
