"""The production front door against real servers: drain on SIGTERM, metrics, API keys, admission
control, request ids and the audit log, the OpenAPI document."""

import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from app.sse_reader import parse_events
from tests.e2e.conftest import FILE_KEY, KEY, start_server

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}


def chat(content="Say something", max_tokens=16, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmRSS:\s+(\d+)", status.read()).group(1))


def test_api_keys_guard_every_v1_route_and_leave_health_open(door):
    base, _, _ = door
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        response = httpx.post(f"{base}/v1/chat/completions", json=chat(), headers=headers, timeout=60)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/v1/models", headers=AUTH).status_code == 200
    file_key = {"Authorization": f"Bearer {FILE_KEY}"}
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=file_key).is_success
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/health/live").status_code == 200
    assert httpx.get(f"{base}/metrics").status_code == 401
    assert httpx.get(f"{base}/metrics", headers=AUTH).status_code == 200


def test_request_ids_are_echoed_or_made_and_audited_without_content(door):
    base, _, audit = door
    mine = httpx.post(
        f"{base}/v1/chat/completions", json=chat(max_tokens=5), headers={**AUTH, "X-Request-Id": "trace-42"}
    )
    assert mine.headers["x-request-id"] == "trace-42"
    made = httpx.post(f"{base}/v1/chat/completions", json=chat(max_tokens=5), headers=AUTH)
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    # A stream's events skip the front door's send (BODY_SEND); its start must still carry the id.
    streamed_body, streamed_headers = chat(max_tokens=5, stream=True), {**AUTH, "X-Request-Id": "trace-43"}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=streamed_body, headers=streamed_headers) as streamed:
        assert streamed.headers["x-request-id"] == "trace-43"
        assert parse_events(streamed.iter_lines())[-1].data == "[DONE]"
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    record = next(line for line in lines if line["request_id"] == "trace-42")
    assert record["completion_id"] == mine.json()["id"]
    assert record["endpoint"] == "/v1/chat/completions" and record["streamed"] is False
    assert record["prompt_tokens"] == mine.json()["usage"]["prompt_tokens"]
    assert record["completion_tokens"] == 5 and record["finish_reasons"] == ["length"]
    assert record["api_key_id"] and KEY not in json.dumps(record)
    assert "prompt" not in record and "output" not in record
    assert record["client"].startswith("127.0.0.1:") and record["ttft_ms"] > 0 and not record["cancelled"]


def audit_lines(audit) -> list[dict]:
    return [json.loads(line) for line in audit.read_text().splitlines()]


def test_every_api_request_gets_one_audit_line_refused_ones_with_status_and_reason(door):
    base, _, audit = door
    wrong = "sk-wrong-key-that-must-not-be-logged"
    sent = {
        "no-key": ("POST", "/v1/chat/completions", {}, chat()),
        "wrong-key": ("POST", "/v1/chat/completions", {"Authorization": f"Bearer {wrong}"}, chat()),
        "too-large": ("POST", "/v1/chat/completions", AUTH, chat(content="x" * 5000)),
        "invalid": ("POST", "/v1/chat/completions", AUTH, {"messages": []}),
        "models": ("GET", "/v1/models", AUTH, None),
        "no-route": ("GET", "/v1/nothing-here", AUTH, None),
    }
    statuses = {}
    for name, (method, path, headers, body) in sent.items():
        response = httpx.request(method, f"{base}{path}", json=body, headers={**headers, "X-Request-Id": f"a-{name}"})
        statuses[name] = response.status_code
    assert statuses == {
        "no-key": 401,
        "wrong-key": 401,
        "too-large": 413,
        "invalid": 400,
        "models": 200,
        "no-route": 404,
    }
    # A line is written once its answer is sent, so it may land just after the client has read the answer.
    deadline = time.monotonic() + 10

    def lines_by_name():
        return {name: [line for line in audit_lines(audit) if line["request_id"] == f"a-{name}"] for name in sent}

    while not all(lines_by_name().values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    text = audit.read_text()
    assert wrong not in text and KEY not in text
    lines = lines_by_name()
    assert all(len(found) == 1 for found in lines.values()), lines
    line = {name: found[0] for name, found in lines.items()}
    for name, (method, path, _, _) in sent.items():
        assert line[name]["status"] == statuses[name] and line[name]["method"] == method
        assert line[name]["endpoint"] == path and line[name]["client"].startswith("127.0.0.1:")
    assert line["no-key"]["code"] == line["wrong-key"]["code"] == "invalid_api_key"
    assert line["no-key"]["api_key_id"] is None and line["wrong-key"]["api_key_id"] is None
    assert "--max-request-bytes" in line["too-large"]["reason"]
    assert line["invalid"]["reason"].startswith("messages") and line["invalid"]["api_key_id"]
    assert line["models"]["reason"] is None and line["models"]["api_key_id"] == line["invalid"]["api_key_id"]


def test_oversized_bodies_get_413_and_the_server_stays_healthy(door):
    base, _, _ = door
    big = chat(content="x" * 5000)
    response = httpx.post(f"{base}/v1/chat/completions", json=big, headers=AUTH)
    assert response.status_code == 413 and response.json()["error"]["message"]

    def chunked():
        yield json.dumps(big).encode()

    response = httpx.post(
        f"{base}/v1/chat/completions", content=chunked(), headers={**AUTH, "Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert httpx.post(f"{base}/v1/chat/completions", json=chat(max_tokens=2), headers=AUTH).is_success


def health_on(sock: socket.socket) -> bytes:
    """GET /health on an open connection: the response, or b"" when the server has closed it."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: sluice\r\n\r\n")
    raw = b""
    while not raw.endswith(b"}"):
        part = sock.recv(65536)
        if not part:
            return raw
        raw += part
    return raw


def test_an_idle_connection_stays_open_longer_than_clients_pools_keep_theirs(server):
    """httpx's pool (the OpenAI SDK's) drops a connection after 5 s idle, as uvicorn's default closes
    it: a request sent as the server closes fails. The server must be the side that waits longer."""
    with socket.create_connection(server.removeprefix("http://").split(":")) as sock:
        assert health_on(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        assert health_on(sock).startswith(b"HTTP/1.1 200")


def test_the_keep_alive_timeout_closes_idle_connections(door):
    base, _, _ = door
    with socket.create_connection(base.removeprefix("http://").split(":")) as sock:
        assert health_on(sock).startswith(b"HTTP/1.1 200")
        time.sleep(1.5)
        assert health_on(sock).startswith(b"HTTP/1.1 200")
        time.sleep(4)  # --timeout-keep-alive 3
        assert health_on(sock) == b""


def test_max_tokens_is_capped_by_the_operator(door):
    base, _, _ = door
    response = httpx.post(f"{base}/v1/chat/completions", json=chat(max_tokens=65), headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    body = chat()
    del body["max_tokens"]
    response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert response.json()["usage"]["completion_tokens"] == 64


def test_a_burst_past_the_queue_bound_gets_429_and_the_rest_completes(door):
    base, pid, audit = door
    httpx.post(f"{base}/v1/chat/completions", json=chat(max_tokens=8), headers=AUTH)
    idle = rss_kib(pid)
    results: list[httpx.Response] = []

    def send():
        results.append(httpx.post(f"{base}/v1/chat/completions", json=chat(max_tokens=24), headers=AUTH, timeout=300))

    threads = [threading.Thread(target=send) for _ in range(8)]  # 4x --max-queue
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [r for r in results if r.status_code == 429]
    served = [r for r in results if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == 8
    for response in refused:
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert int(response.headers["retry-after"]) >= 1
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in served)
    assert rss_kib(pid) <= 1.2 * idle
    lines = audit_lines(audit)
    for response in refused:
        (line,) = [line for line in lines if line["request_id"] == response.headers["x-request-id"]]
        assert line["status"] == 429 and line["code"] == "queue_full" and "--max-queue" in line["reason"]


def test_metrics_count_a_known_workload(door):
    base, _, _ = door

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{base}/metrics", headers=AUTH).text
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("sluice:")
        }

    before = scrape()
    prompt_tokens = 0
    for max_tokens in (3, 5, 7):
        body = chat(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=AUTH) as response:
            events = parse_events(response.iter_lines())
        prompt_tokens += events[-2].json()["usage"]["prompt_tokens"]
    after = scrape()
    model = httpx.get(f"{base}/v1/models", headers=AUTH).json()["data"][0]["id"]
    label = f'model_name="{model}"'

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta(f"sluice:generation_tokens_total{{{label}}}") == 15
    assert delta(f"sluice:prompt_tokens_total{{{label}}}") == prompt_tokens
    # prometheus-client writes labels in name order.
    assert delta(f'sluice:request_success_total{{finished_reason="length",{label}}}') == 3
    assert delta(f"sluice:time_to_first_token_seconds_count{{{label}}}") == 3
    assert delta(f"sluice:e2e_request_latency_seconds_count{{{label}}}") == 3
    # Inter-token gaps: one fewer than the chunks with tokens per stream (a lagging reader's merge less).
    assert 3 <= delta(f"sluice:inter_token_latency_seconds_count{{{label}}}") <= 2 + 4 + 6
    status = 'handler="/v1/chat/completions",method="POST",status="200"'
    assert delta(f"sluice:http_requests_total{{{status}}}") == 3
    assert after[f"sluice:num_requests_running{{{label}}}"] == 0
    assert 0 <= after[f"sluice:kv_cache_usage_perc{{{label}}}"] <= 1


def test_the_openapi_document_lists_every_error_status():
    from app.server import create_app
    from app.settings import Settings

    schema = create_app(Settings()).openapi()
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(responses)
    assert "422" not in responses
    error = responses["429"]["content"]["application/json"]["schema"]["$ref"]
    assert error.endswith("/ErrorResponse")


async def test_an_unexpected_error_s_500_carries_the_request_id():
    # In process, with a route that fails: the front door sits outside Starlette's error layer.
    from app.server import create_app
    from app.settings import Settings

    app = create_app(Settings())

    @app.get("/fails")
    async def fails():
        raise RuntimeError("on purpose")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://sluice") as client:
        response = await client.get("/fails", headers={"X-Request-Id": "trace-500"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "trace-500"
    assert response.json()["error"]["message"] == "internal error: on purpose"


async def test_under_ray_serve_the_id_header_is_left_to_its_layer_and_its_id_kept():
    # Ray Serve's layer around a cluster's app returns the request's id (any it got, or one it made) itself.
    from app.operations.front_door import request_id_var
    from app.server import create_app
    from app.settings import Settings

    app = create_app(Settings(), id_header=False)

    @app.get("/id")
    async def current_id() -> str:
        return request_id_var.get()

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sluice") as client:
        response = await client.get("/id", headers=[("X-Request-Id", "Ray's id"), ("X-Request-Id", "second")])
    assert "x-request-id" not in response.headers
    assert response.json() == "Ray's id"


def start_streams(base: str, max_tokens: list[int]) -> tuple[dict[int, list], list[threading.Thread]]:
    """One streamed chat per entry, each read to its end on a thread; returns once all run together."""
    streams: dict[int, list] = {}

    def read(index: int) -> None:
        body = chat(content=f"Tell story {index}", max_tokens=max_tokens[index], stream=True)
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as response:
            streams[index] = parse_events(response.iter_lines())

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(max_tokens))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while httpx.get(f"{base}/health").json()["num_running"] < len(max_tokens):
        assert time.monotonic() < deadline, "the streams never ran together"
        time.sleep(0.05)
    return streams, threads


def test_sigterm_drains_running_streams_then_exits_zero(default_model_path, tmp_path):
    with (tmp_path / "stderr").open("wb") as log:
        proc, base = start_server("--shutdown-timeout", "5", "--max-num-seqs", "8", stderr=log)
    # Four finish inside the timeout, four cannot.
    streams, threads = start_streams(base, [24] * 4 + [4000] * 4)

    proc.send_signal(signal.SIGTERM)
    ready = httpx.get(f"{base}/health")
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert httpx.get(f"{base}/health/live").status_code == 200
    refused = httpx.post(f"{base}/v1/chat/completions", json=chat())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "draining"
    for thread in threads:
        thread.join(timeout=60)
    assert proc.wait(timeout=60) == 0
    assert sorted(streams) == list(range(8))
    for index, events in streams.items():
        assert events[-1].data == "[DONE]"
        last = events[-2].json()
        if index < 4:
            assert last["choices"][0]["finish_reason"] == "length"
        else:
            assert last["error"]["message"] == "the server is shutting down"
    # A quiet exit: no traceback, and nothing from extensions' teardown (Triton's nanobind printed a
    # screenful of "leaked" warnings after every shutdown where it is installed).
    stderr = (tmp_path / "stderr").read_text()
    assert "Traceback" not in stderr and "leaked" not in stderr, stderr[-2000:]


def test_a_second_signal_ends_every_stream_at_once(default_model_path):
    proc, base = start_server("--shutdown-timeout", "120")
    streams, threads = start_streams(base, [4000] * 3)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    # Not the 120 s of the timeout: the second signal skipped the wait.
    assert time.monotonic() - signalled < 30
    for thread in threads:
        thread.join(timeout=30)
    for events in streams.values():
        assert events[-1].data == "[DONE]"
        assert events[-2].json()["error"]["message"] == "the server is shutting down"
    assert len(streams) == 3
