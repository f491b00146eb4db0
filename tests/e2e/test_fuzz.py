"""Schemathesis over /openapi.json against a real server, with its default checks: no 5xx, every
status and content type documented, every schema-valid request accepted and every invalid one refused.

The server runs a tiny random model (what is fuzzed is what the API accepts and answers, not the
text) and keeps generation short (`--max-tokens-limit 8`), so each of the fuzzer's requests takes
milliseconds; every route and method of the document is exercised, with valid and invalid data.
(Hypothesis drives each operation directly: schemathesis's pytest plugin does not load under pytest 9.)
The whole run, `st run` against the same server, is in docs/api.md.
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

pytestmark = pytest.mark.slow
# Per operation and mode: bounded, so that the file takes well under a minute on an idle machine.
EXAMPLES = 12


# Parameters whose validity a JSON Schema cannot state (a regex, grammar or schema that compiles, a
# tool_choice naming one of the tools, an event number within a response), refused with 400 all the
# same; docs/api.md lists them. Their rules that can be stated are declared, so not excused here.
UNDECLARABLE = {"guided_regex", "guided_grammar", "guided_json", "structured_outputs", "response_format"}
UNDECLARABLE |= {"structured_outputs.json", "text.format", "tools", "tool_choice", "starting_after"}
# A grammar that compiles but asks for text no token can write (a stream's first event, or a 400).
UNWRITABLE = "cannot be followed with this model's tokens"
# A prompt of text the tokenizer drops (control characters) leaves no token to start from.
EMPTY = "The prompt is empty once tokenized"
DECLARED = ("only one output constraint", "cannot be combined with tools", "tool_choice is only allowed")


def undeclarable(response) -> bool:
    """A 400 for what the document cannot declare: a prompt over the context or of no tokens, a grammar
    that does not compile or that the vocabulary cannot write."""
    if response.status_code != 400:
        return False
    error = response.json()["error"]
    if error["code"] == "context_length_exceeded" or UNWRITABLE in error["message"] or EMPTY in error["message"]:
        return True
    return error["param"] in UNDECLARABLE and not any(rule in error["message"] for rule in DECLARED)


@pytest.fixture(scope="module")
def api(tiny_server):
    return tiny_server, schemathesis.openapi.from_url(f"{tiny_server}/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_default_checks_pass(api, mode):
    base, schema = api
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/models",
        "/health",
    }
    fuzzed = set()
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        # The same cases every run, so that the suite fails for a change and not by the draw: new cases
        # are `st run`'s to find (docs/api.md), and each bug found there is pinned below.
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,
        )
        def fuzz(case):
            response = case.call(base_url=base, timeout=60)
            if not undeclarable(response):
                case.validate_response(response)

        try:
            fuzz()
        except Unsatisfiable:
            # Nothing invalid to send to an operation without parameters or a body.
            assert mode == GenerationMode.NEGATIVE
            continue
        fuzzed.add(operation.path)
    assert {"/v1/chat/completions", "/v1/completions"} <= fuzzed


def test_an_undeclared_method_gets_405_with_allow_and_a_bare_tool_message_400(api):
    base, _ = api
    for method, path in (("TRACE", "/health"), ("PUT", "/v1/chat/completions"), ("POST", "/v1/models")):
        response = httpx.request(method, f"{base}{path}")
        assert response.status_code == 405 and response.headers["allow"], (method, path)
    assert httpx.post(f"{base}/v1/chat/completions").headers["content-type"] == "application/json"
    response = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "tool"}]})
    assert response.status_code == 400 and "tool_call_id" in response.json()["error"]["message"]


def test_what_the_fuzzer_found_stays_fixed(api):
    base, _ = api
    messages = [{"role": "user", "content": "hi"}]
    # 1.0 is an integer to JSON Schema, so to the document; 1e-308 is a valid temperature (its inverse
    # overflowed the sampler's float32, a 500).
    response = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, "n": 1.0, "temperature": 1e-308})
    assert response.status_code == 200, response.text
    # A top_k past the vocabulary keeps every token (it overflowed the sampler's int32, a 500).
    response = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, "top_k": 2**40})
    assert response.status_code == 200, response.text
    # Strict types: no boolean from 0, no number from a string.
    for field, value in (("stream", 0), ("max_tokens", "2"), ("n", 1.5)):
        response = httpx.post(f"{base}/v1/chat/completions", json={"messages": messages, field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, (field, value)
    # A prompt that tokenizes to nothing (a step of no tokens failed every stream in it, a 500).
    for prompt in ("\u0004", ["\u0004"]):
        response = httpx.post(f"{base}/v1/completions", json={"prompt": prompt})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text
        assert EMPTY in response.json()["error"]["message"]
    # A bad value inside a union (text or parts) is named by the request's own fields, not pydantic's branch
    # labels (was "input.str: Input should be a valid string" for a list of parts).
    part = {"type": "image_url", "image_url": {"url": 5}}
    cases = (
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [part]}]},
            "messages.0.content.0.image_url.url",
        ),
        ("/v1/responses", {"input": [{"type": "input_file", "file_id": "f"}]}, "input.0"),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            "input.0.content.0.text",
        ),
    )
    for path, body, param in cases:
        response = httpx.post(f"{base}{path}", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    # JSON Schema's boolean schemas: true admits any value, false none (both were "Expecting object schema").
    response = httpx.post(f"{base}/v1/completions", json={"prompt": "0", "guided_json": True, "max_tokens": 4})
    assert response.status_code == 200, response.text
    response = httpx.post(f"{base}/v1/completions", json={"prompt": "0", "guided_json": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_json", response.text
    assert "admits no JSON value" in response.json()["error"]["message"]
    # A completion's default of 16 tokens gives way to --max-tokens-limit (8) rather than refusing.
    response = httpx.post(f"{base}/v1/completions", json={"prompt": "0"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 8
    # A repetition penalty of 1e-300 is 0 in float32: its infinite logits sampled tokens of no text. It
    # now draws as 1e-5, below which the tokens seen already outweigh every other alike.
    texts = [
        httpx.post(
            f"{base}/v1/completions",
            json={"prompt": "hello world", "seed": 0, "repetition_penalty": penalty, "max_tokens": 4},
        ).json()["choices"][0]["text"]
        for penalty in (1e-300, 1e-5)
    ]
    assert texts[0] == texts[1] != "", texts
    # The document's integer bounds are exact: as floats (FastAPI's), a validator comparing in floats took
    # a seed of -2**63 - 191 for one within -2**63, which the server refuses.
    document = httpx.get(f"{base}/openapi.json").json()
    seed = document["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["exclusiveMaximum"]) == (-(2**63), 2**64), seed
    assert all(isinstance(bound, int) for bound in (seed["minimum"], seed["exclusiveMaximum"])), seed
    # A completion reads no tools, so the rule that tools in use allow only a JSON constraint is not its
    # own: declared on it, the document refused a completion with tools and a guided_regex that the
    # server answers (st run --seed 11, negative mode: a schema-violating request accepted).
    schema = document["components"]["schemas"]["CompletionRequest"]
    assert "tools" not in str(schema), schema.get("allOf")
    body = {"prompt": "0", "tools": [{}], "tool_choice": "auto", "guided_regex": "[0-9]"}
    response = httpx.post(f"{base}/v1/completions", json=body)
    assert response.status_code == 200, response.text
