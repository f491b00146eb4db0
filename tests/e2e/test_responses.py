"""The Responses API on the default model: the OpenAI SDK's create / stream, stored conversations,
resume, cancel and delete."""

import json
import time

import httpx
import openai
import pytest

from app.sse_reader import iter_events

pytestmark = pytest.mark.slow

TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING_EVENTS = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(f"{server}/v1/models").json()["data"][0]["id"]


def test_create_returns_a_completed_response(client, model):
    response = client.responses.create(model=model, input="Name three colors.", max_output_tokens=24, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output_text
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_streamed_events_come_in_order_with_sequence_numbers(client, model):
    events = list(
        client.responses.create(
            model=model, input="Name three colors.", max_output_tokens=24, temperature=0, stream=True
        )
    )
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == TEXT_EVENTS
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas) : -1] == CLOSING_EVENTS
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert final.response.output_text == "".join(d.delta for d in deltas)
    whole = client.responses.create(model=model, input="Name three colors.", max_output_tokens=24, temperature=0)
    assert whole.output_text == final.response.output_text


def test_the_stream_helper_gives_the_final_response(client, model):
    with client.responses.stream(model=model, input="Say hello.", max_output_tokens=200, temperature=0) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(texts)


def test_a_chain_of_five_turns_equals_the_whole_history_sent_as_chat(client, model):
    questions = ["What is bread?", "And butter?", "Which is older?", "Say it in one word.", "Thanks!"]
    previous = None
    history = []
    replies, cached = [], []
    for question in questions:
        response = client.responses.create(
            model=model, input=question, previous_response_id=previous, max_output_tokens=24, temperature=0
        )
        previous = response.id
        replies.append(response.output_text)
        cached.append(response.usage.input_tokens_details.cached_tokens)
    for question, reply in zip(questions, replies):
        history.append({"role": "user", "content": question})
        chat = client.chat.completions.create(model=model, messages=history, max_tokens=24, temperature=0)
        assert chat.choices[0].message.content == reply
        history.append({"role": "assistant", "content": reply})
    # From the second turn on, the earlier turns' KV comes back from the pinned prefix.
    assert all(c > 0 for c in cached[1:])


def test_deleted_or_unknown_responses_get_404(client, model, server):
    response = client.responses.create(model=model, input="Hi.", max_output_tokens=8)
    pinned = httpx.get(f"{server}/health").json()["kv_blocks_pinned"]
    assert pinned > 0
    # The SDK's delete returns None whatever the body says: read the body itself.
    deleted = httpx.delete(f"{server}/v1/responses/{response.id}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": response.id, "object": "response", "deleted": True}
    for call in (
        lambda: client.responses.retrieve(response.id),
        lambda: client.responses.create(model=model, input="Again?", previous_response_id=response.id),
        lambda: client.responses.delete(response.id),
    ):
        with pytest.raises(openai.NotFoundError) as error:
            call()
        assert error.value.body["code"] == "response_not_found"
    assert httpx.get(f"{server}/health").json()["kv_blocks_pinned"] < pinned


def test_starting_after_resumes_where_a_dropped_stream_left_off(server):
    body = {"input": "Write a long story about a dragon.", "max_output_tokens": 60, "temperature": 0, "stream": True}
    seen = []
    with httpx.stream("POST", f"{server}/v1/responses", json=body, timeout=120) as stream:
        for event in iter_events(stream.iter_lines()):
            seen.append(event.json())
            if len(seen) == 8:
                break
    response_id = seen[0]["response"]["id"]
    url = f"{server}/v1/responses/{response_id}?stream=true&starting_after={seen[-1]['sequence_number']}"
    with httpx.stream("GET", url, timeout=120) as stream:
        rest = [e.json() for e in iter_events(stream.iter_lines())]
    with httpx.stream("GET", f"{server}/v1/responses/{response_id}?stream=true", timeout=120) as stream:
        whole = [e.json() for e in iter_events(stream.iter_lines())]
    assert seen + rest == whole
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert whole[-1]["type"] in ("response.completed", "response.incomplete")


def test_cancel_stops_a_response_and_frees_its_work(server):
    body = {"input": "Count to one thousand.", "max_output_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/responses", json=body, timeout=120) as stream:
        events = iter_events(stream.iter_lines())
        created = next(events).json()
        response_id = created["response"]["id"]
        cancelled = httpx.post(f"{server}/v1/responses/{response_id}/cancel", timeout=60).json()
        rest = [e.json() for e in events]
    assert cancelled["status"] == "cancelled"
    assert rest[-1]["response"]["status"] == "cancelled"
    health = httpx.get(f"{server}/health").json()
    assert health["num_running"] == 0


def test_structured_output_and_function_tools(client, model):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    formatted = client.responses.create(
        model=model,
        input="Weather report as JSON.",
        text={"format": {"type": "json_schema", "name": "report", "schema": schema, "strict": True}},
        max_output_tokens=60,
    )
    assert set(json.loads(formatted.output_text)) == {"city", "sunny"}
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    }
    one_call = dict(tools=[tool], tool_choice="required", parallel_tool_calls=False, max_output_tokens=60)
    one_call["temperature"] = 0
    called = client.responses.create(model=model, input="Weather in Oslo?", **one_call)
    assert called.status == "completed"
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    with client.responses.stream(model=model, input="Weather in Oslo?", **one_call) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = [item for item in stream.get_final_response().output if item.type == "function_call"]
    assert "".join(deltas) == streamed[0].arguments == calls[0].arguments
    answer = client.responses.create(
        model=model,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"sky": "clear"}'}],
        max_output_tokens=20,
    )
    assert answer.status in ("completed", "incomplete")


def test_an_engine_failure_ends_the_stream_with_error_and_response_failed(server, health):
    body = {"input": "Write a long essay.", "max_output_tokens": 2000, "ignore_eos": True, "stream": True}
    # Not stored: nothing of it stays pinned on the shared server.
    body["store"] = False
    with httpx.stream("POST", f"{server}/v1/responses", json=body, timeout=120) as stream:
        events = iter_events(stream.iter_lines())
        assert next(events).json()["type"] == "response.created"
        deadline = time.monotonic() + 30
        while health()["num_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.post(f"{server}/debug/fault").status_code == 200
        rest = [e.json() for e in events]
    error, failed = rest[-2], rest[-1]
    assert error["type"] == "error" and "injected fault" in error["message"] and error["code"] == "server_error"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == error["message"]
    assert health()["num_running"] == 0
