"""Every request parameter, through the OpenAI SDK, changes the output as docs/api.md says."""

from collections import Counter

import httpx
import openai
import pytest

from app.sse_reader import read_events

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
LIST = [{"role": "user", "content": "List the days of the week, one per line."}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def chat(client, model, messages=STORY, **params):
    params.setdefault("max_tokens", 24)
    params.setdefault("temperature", 0)
    return client.chat.completions.create(model=model, messages=messages, **params)


def streamed(client, model, messages=STORY, **params):
    """Text per choice index, finish reason per index, and every chunk."""
    chunks = list(chat(client, model, messages, stream=True, **params))
    texts, reasons = {}, {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                assert choice.index not in reasons, "a second finish for one choice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def token_texts(client, model, messages=STORY, **params) -> list[str]:
    response = chat(client, model, messages, logprobs=True, **params)
    return [entry.token for entry in response.choices[0].logprobs.content]


def test_stop_string_straddling_tokens_is_never_streamed(client, model_name):
    tokens = token_texts(client, model_name, max_tokens=30)
    full = "".join(tokens)
    # A stop string made of the end of one token and the start of the next, well inside the text.
    i = next(i for i in range(8, len(tokens) - 1) if len(tokens[i]) >= 2 and len(tokens[i + 1]) >= 2)
    stop = tokens[i][-2:] + tokens[i + 1][:2]
    cut = full[: full.index(stop)]
    texts, reasons, _ = streamed(client, model_name, max_tokens=30, stop=[stop, "zzzz"])
    assert texts[0] == cut and reasons[0] == "stop"
    whole = chat(client, model_name, max_tokens=30, stop=stop)
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_output(client, model_name, default_tokenizer):
    tokens = token_texts(client, model_name, max_tokens=20)
    # The first of the generated tokens, past the first few, that is longer than two characters, not
    # generated before, and encodes alone to one id: byte-level tokens are one per byte string, so that
    # id is the one the model generated there.
    k, stop_id = next(
        (k, ids[0])
        for k in range(3, len(tokens))
        if len(tokens[k]) > 2
        and tokens[k] not in tokens[:k]
        and len(ids := default_tokenizer.encode(tokens[k], add_special_tokens=False)) == 1
    )
    assert default_tokenizer.decode([stop_id]) == tokens[k]
    response = chat(client, model_name, max_tokens=20, extra_body={"stop_token_ids": [stop_id]})
    assert response.choices[0].finish_reason == "stop"
    # The stop token is counted but not shown.
    assert response.choices[0].message.content == "".join(tokens[:k])
    assert response.usage.completion_tokens == k + 1


def test_n_choices_stream_reassembles_into_complete_choices(client, model_name):
    params = dict(max_tokens=16, temperature=1.0, seed=11, n=3)
    texts, reasons, chunks = streamed(client, model_name, stream_options={"include_usage": True}, **params)
    assert sorted(texts) == [0, 1, 2] and sorted(reasons) == [0, 1, 2]
    assert all(texts.values()) and len(set(texts.values())) > 1
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens <= 3 * 16
    whole = chat(client, model_name, **params)
    assert [c.message.content for c in whole.choices] == [texts[i] for i in range(3)]
    assert whole.usage.completion_tokens == usage.completion_tokens


def test_chat_logprobs_parse_into_the_sdk_types(client, model_name):
    response = chat(client, model_name, max_tokens=12, logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 12
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode(errors="replace") == entry.token
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    _, _, chunks = streamed(client, model_name, max_tokens=12, logprobs=True, top_logprobs=3)
    streamed_entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed_entries] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]


def test_completion_logprobs_have_offsets_into_the_text(client, model_name):
    response = client.completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2
    )
    choice = response.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert all(len(top) <= 2 and logprobs.tokens[i] in top for i, top in enumerate(logprobs.top_logprobs))


def test_usage_counts_match_the_tokenizer(client, model_name, default_tokenizer):
    _, _, chunks = streamed(client, model_name, max_tokens=10, stream_options={"include_usage": True})
    usage = chunks[-1].usage
    prompt_ids = default_tokenizer.apply_chat_template(STORY, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == 10 and usage.total_tokens == usage.prompt_tokens + 10
    assert all(c.usage is None for c in chunks[:-1])


def test_a_resent_conversation_is_served_from_the_prefix_cache(server, client, model_name):
    first = chat(client, model_name, max_tokens=16)
    history = [*STORY, {"role": "assistant", "content": first.choices[0].message.content}]
    before = httpx.get(f"{server}/health").json()
    follow_up = chat(client, model_name, [*history, {"role": "user", "content": "Give it a title."}], max_tokens=8)
    after = httpx.get(f"{server}/health").json()
    cached = follow_up.usage.prompt_tokens_details.cached_tokens
    # At least the full 16-token blocks of the first prompt (system prompt and story request).
    assert first.usage.prompt_tokens // 16 * 16 <= cached < follow_up.usage.prompt_tokens
    assert cached % 16 == 0 and follow_up.timings["cache_n"] == cached
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == cached
    assert after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"] == follow_up.usage.prompt_tokens
    assert 0 < after["prefix_cache_hit_rate"] <= 1


def test_penalties_change_a_repetitive_output(client, model_name):
    # 80 tokens: in float32 (the default on a CPU) the first 40 of the list come out the same
    # under a presence penalty; the days' names repeat on every line and diverge later.
    plain = chat(client, model_name, LIST, max_tokens=80).choices[0].message.content
    for params in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 1.8}},
    ):
        penalized = chat(client, model_name, LIST, max_tokens=80, **params).choices[0].message.content
        assert penalized != plain, params

    # The most repeated token of a list (the newline, " =") repeats less under a frequency penalty.
    def top_repeat(**params) -> int:
        return max(Counter(token_texts(client, model_name, messages=LIST, max_tokens=40, **params)).values())

    assert top_repeat(frequency_penalty=2.0) < top_repeat()


def test_logit_bias_forces_a_token(client, model_name, default_tokenizer):
    (banana,) = default_tokenizer.encode(" banana", add_special_tokens=False)
    response = chat(client, model_name, max_tokens=5, logit_bias={str(banana): 100})
    assert response.choices[0].message.content == " banana" * 5


def test_min_p_one_is_greedy_and_seeds_reproduce(client, model_name):
    # min_p = 1 keeps only the most likely token (or the tokens tied for it), even at temperature 1.5.
    response = chat(
        client, model_name, max_tokens=16, temperature=1.5, logprobs=True, top_logprobs=1, extra_body={"min_p": 1.0}
    )
    assert all(entry.logprob == entry.top_logprobs[0].logprob for entry in response.choices[0].logprobs.content)
    seeded = [
        chat(client, model_name, max_tokens=16, temperature=1.0, seed=s).choices[0].message.content for s in (1, 1, 2)
    ]
    assert seeded[0] == seeded[1] != seeded[2]


def test_max_completion_tokens_and_ignore_eos(client, model_name):
    short = [{"role": "user", "content": "Reply with just the word OK."}]
    natural = chat(client, model_name, short, max_completion_tokens=40)
    assert natural.choices[0].finish_reason == "stop" and natural.usage.completion_tokens < 40
    forced = chat(client, model_name, short, max_completion_tokens=40, extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 40


def test_stream_interval_groups_tokens_per_chunk(client, model_name):
    _, _, chunks = streamed(client, model_name, max_tokens=12, logprobs=True, extra_body={"stream_interval": 4})
    sizes = [len(ch.logprobs.content) for c in chunks for ch in c.choices if ch.logprobs and ch.logprobs.content]
    assert sizes == [4, 4, 4]


def test_last_chunk_carries_timings(server, model_name):
    body = {"model": model_name, "messages": STORY, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as r:
        payloads = [e.json() for e in read_events(r) if e.data != "[DONE]"]
    assert [("timings" in p) for p in payloads] == [False] * (len(payloads) - 1) + [True]
    timings = payloads[-1]["timings"]
    assert timings["predicted_n"] == 8 and timings["prompt_n"] > 0
    assert 0 <= timings["queue_ms"] <= timings["ttft_ms"] and timings["predicted_per_second"] > 0


BAD_REQUESTS = [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 1000}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"word": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stream_interval": 0}, "stream_interval"),
    ({"max_tokens": 10_000_000}, "max_tokens"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_out_of_range_parameters_get_a_400_naming_them(server, model_name, fields, param):
    body = {"model": model_name, "messages": STORY, **fields}
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and error["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored(client, model_name):
    response = chat(client, model_name, max_tokens=3, extra_body={"no_such_field": 1, "store": True})
    assert response.usage.completion_tokens == 3
