"""Schemathesis over /openapi.json against a real server: no 5xx, no status the document does not list.

The server runs a tiny random model (what is fuzzed is what the API accepts and answers, not the
text) and keeps generation short (`--max-model-len 64`, `--max-tokens-limit 8`), so each of the
fuzzer's requests takes milliseconds; every route and method of the document is exercised, with
valid and invalid data. (Hypothesis drives each operation directly: schemathesis's pytest plugin does
not load under pytest 9.) Examples per operation: the hypothesis profile's (tests/conftest.py).
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(tiny_server):
    return tiny_server, schemathesis.openapi.from_url(f"{tiny_server}/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_error_and_no_undocumented_status(api, mode):
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
        @settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            case.call_and_validate(base_url=base, checks=[not_a_server_error, status_code_conformance], timeout=60)

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
