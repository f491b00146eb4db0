"""Schemathesis over /openapi.json against a real server: no 5xx, no status the document does not list.

The server keeps generation short (`--max-model-len 64`, `--max-tokens-limit 8`) so each of the
fuzzer's requests is quick; every route and method of the document is exercised, with valid
and invalid data. (Hypothesis drives each operation directly: schemathesis's pytest plugin does
not load under pytest 9.)
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.e2e.conftest import start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(default_model_path):
    proc, base = start_server("--max-model-len", "64", "--max-tokens-limit", "8")
    yield base, schemathesis.openapi.from_url(f"{base}/openapi.json")
    proc.terminate()
    proc.wait(timeout=30)


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
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
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
