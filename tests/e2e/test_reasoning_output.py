"""Reasoning output through a real server of a tiny random Qwen3 that thinks in `<think>…</think>`
(tests/e2e/conftest.py thinking_model_path): the reasoning comes apart from the answer for the OpenAI
SDK, LangChain and raw SSE, in chat and the Responses API, streamed and not.

The reference is the server's own raw output of the same prompt through /v1/completions (which never
splits reasoning), split by hand at `</think>`: the chat output must be that, apart."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI
from transformers import AutoTokenizer

from app.serving.prompting import chat_prompt_ids
from app.serving.protocol import ChatCompletionRequest
from app.sse_reader import read_events
from tests.e2e.conftest import THINKING_MESSAGES

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
PRIME_PARAMETERS = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.fixture(scope="module")
def tokenizer(thinking_model_path):
    return AutoTokenizer.from_pretrained(thinking_model_path)


@pytest.fixture(scope="module")
def client(thinking_server):
    return openai.OpenAI(base_url=f"{thinking_server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(thinking_server):
    return httpx.get(f"{thinking_server}/v1/models").json()["data"][0]["id"]


def prompt_ids(tokenizer, messages, **template_kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def raw_completion(base: str, ids: list[int], max_tokens: int = MAX_TOKENS, **extra) -> tuple[str, list[str]]:
    """The server's greedy output of these prompt ids, unsplit: its text and its tokens' texts."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0, **extra}
    choice = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def reference(thinking_server, tokenizer) -> tuple[str, str, int]:
    """(reasoning, answer, reasoning tokens) of THINKING_MESSAGES, split by hand: the template opened
    the reasoning in the prompt, so the output thinks until its first `</think>`."""
    text, tokens = raw_completion(thinking_server, prompt_ids(tokenizer, THINKING_MESSAGES))
    assert "</think>" in text, "the thinking model did not end its reasoning (see thinking_model_path)"
    reasoning, answer = text.split("</think>", 1)
    assert reasoning and answer
    return reasoning, answer, tokens.index("</think>")


def chat(client, model, **extra):
    return client.chat.completions.create(
        model=model, messages=THINKING_MESSAGES, **{"max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    )


def test_the_sdk_gets_the_reasoning_apart_from_the_content(client, model, reference):
    reasoning, answer, num_reasoning = reference
    completion = chat(client, model)
    message = completion.choices[0].message
    assert message.content == answer
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == reasoning
    assert completion.usage.completion_tokens_details.reasoning_tokens == num_reasoning
    assert completion.usage.completion_tokens == MAX_TOKENS


def test_streamed_reasoning_comes_first_and_folds_to_the_whole_response(client, model, reference):
    reasoning, answer, num_reasoning = reference
    stream = chat(client, model, stream=True, stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            if thought := (delta.model_extra or {}).get("reasoning_content"):
                assert delta.model_extra["reasoning"] == thought
                parts.append(("reasoning", thought))
            if delta.content:
                parts.append(("content", delta.content))
            finish = choice.finish_reason or finish
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content"), "reasoning after content"
    assert "".join(text for kind, text in parts if kind == "reasoning") == reasoning
    assert "".join(text for kind, text in parts if kind == "content") == answer
    assert usage.completion_tokens_details.reasoning_tokens == num_reasoning and finish == "length"


def test_langchain_keeps_the_reasoning_out_of_the_content(thinking_server, model, reference):
    reasoning, answer, _ = reference
    llm = ChatOpenAI(
        base_url=f"{thinking_server}/v1", api_key="unused", model=model, temperature=0, max_tokens=MAX_TOKENS
    )
    assert llm.invoke(THINKING_MESSAGES).content == answer
    assert "".join(chunk.content for chunk in llm.stream(THINKING_MESSAGES)) == answer


def test_a_stream_cut_while_thinking_ends_with_its_terminal_chunk_and_done(thinking_server, model, reference):
    reasoning, _, num_reasoning = reference
    cut = num_reasoning - 1
    body = {"model": model, "messages": THINKING_MESSAGES, "max_tokens": cut, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{thinking_server}/v1/chat/completions", json=body, timeout=60) as response:
        events = read_events(response)
    assert events[-1].data == "[DONE]"
    chunks = [event.json()["choices"][0] for event in events[:-1]]
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]
    assert chunks[-1]["finish_reason"] == "length"
    assert not "".join(c["delta"].get("content") or "" for c in chunks)
    thought = "".join(c["delta"].get("reasoning_content") or "" for c in chunks)
    assert thought and reasoning.startswith(thought)


def test_enable_thinking_false_reaches_the_template(client, model, thinking_server, tokenizer):
    answer, _ = raw_completion(thinking_server, prompt_ids(tokenizer, THINKING_MESSAGES, enable_thinking=False))
    message = chat(client, model, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert message.content == answer
    assert "reasoning_content" not in (message.model_extra or {})


@pytest.mark.parametrize("kwargs", ["enable_thinking=false", ["enable_thinking"], 1, {"add_generation_prompt": False}])
def test_malformed_chat_template_kwargs_are_refused(thinking_server, model, kwargs):
    body = {"model": model, "messages": THINKING_MESSAGES, "chat_template_kwargs": kwargs}
    response = httpx.post(f"{thinking_server}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_stop_strings_apply_to_the_content_only(client, model, reference):
    reasoning, answer, _ = reference
    inside = next(reasoning[i : i + 3] for i in range(len(reasoning) - 2) if reasoning[i : i + 3] not in answer)
    message = chat(client, model, stop=[inside]).choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning and message.content == answer
    answer_stop = answer[3:6]
    message = chat(client, model, stop=[answer_stop]).choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning
    assert message.content == answer[: answer.index(answer_stop)]


def test_structured_output_constrains_the_answer_not_the_thinking(client, model, reference):
    reasoning, _, _ = reference
    schema = {"type": "object", "properties": {"prime": {"type": "boolean"}}, "required": ["prime"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    message = chat(client, model, response_format=response_format, max_tokens=64).choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning
    assert isinstance(json.loads(message.content)["prime"], bool)


def test_a_tool_call_follows_the_reasoning(client, model, tokenizer, thinking_server):
    # The reference: the server's raw output of the same prompt (the tools in its system prompt, as the
    # chat route renders it), split by hand: the grammar of a required call starts after `</think>`.
    # The model was made to end its reasoning for THINKING_MESSAGES' prompt alone: under this longer
    # one, `</think>`'s score is about 8.7 below the best at the 6th token and 10.4 or more before, so a
    # bias of 9.5 has it end there.
    tools = [{"type": "function", "function": {"name": "is_prime", "parameters": PRIME_PARAMETERS}}]
    body = {"model": model, "messages": THINKING_MESSAGES, "tools": tools, "tool_choice": "required"}
    request = ChatCompletionRequest(**body)
    ids = chat_prompt_ids(tokenizer, request.messages, request.tool_use())
    bias = {"logit_bias": {str(tokenizer.convert_tokens_to_ids("</think>")): 9.5}}
    text, _ = raw_completion(thinking_server, ids, max_tokens=64, **bias)
    assert "</think>" in text, "the thinking model did not end its reasoning before the call"
    reasoning = text.split("</think>", 1)[0]
    assert reasoning

    choice = chat(client, model, tools=tools, tool_choice="required", max_tokens=64, **bias).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == reasoning and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "is_prime" and isinstance(json.loads(call.function.arguments)["n"], int)

    kinds, thought, arguments = [], "", ""
    for chunk in chat(client, model, tools=tools, tool_choice="required", max_tokens=64, stream=True, **bias):
        for delta in [c.delta for c in chunk.choices]:
            if delta.model_extra.get("reasoning_content"):
                kinds.append("reasoning")
                thought += delta.model_extra["reasoning_content"]
            if delta.tool_calls:
                kinds.append("call")
                arguments += delta.tool_calls[0].function.arguments or ""
    assert kinds == sorted(kinds, key=["reasoning", "call"].index) and "call" in kinds
    assert (thought, arguments) == (reasoning, call.function.arguments)


def test_the_responses_api_returns_a_reasoning_item_before_the_message(client, model, reference, thinking_server):
    reasoning, answer, num_reasoning = reference
    request = {"model": model, "input": THINKING_MESSAGES, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    response = client.responses.create(**request)
    thought, message = response.output
    assert thought.type == "reasoning" and thought.summary == []
    assert [(part.type, part.text) for part in thought.content] == [("reasoning_text", reasoning)]
    assert message.type == "message" and message.content[0].text == answer
    assert response.usage.output_tokens_details.reasoning_tokens == num_reasoning
    with httpx.stream("POST", f"{thinking_server}/v1/responses", json={**request, "stream": True}, timeout=60) as r:
        events = [event.json() for event in read_events(r)]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    (done,) = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert deltas == done["text"] == reasoning
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message"]
    assert final[0]["content"] == [{"type": "reasoning_text", "text": reasoning}]
    assert final[1]["content"][0]["text"] == answer
