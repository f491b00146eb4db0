"""Sluice on Ray Serve (`sluice cluster`): a local Ray cluster of 2 engine replicas of a tiny random Llama,
started once for this module, against one plain server of the same model and flags."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from app import server_process
from app.sse_reader import parse_events, read_events
from tests.conftest import CACHE_DIR
from tests.e2e.conftest import serve

pytest.importorskip("ray.serve", reason="the cluster needs the `ray` extra")
pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "1024", "--kv-cache-gib", "0.05", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def cluster(tiny_model_path) -> Iterator[str]:
    """`sluice cluster --replicas 2`: Ray's start-up and two replicas take a minute or two on 2 cores."""
    flags = ["--device", "cpu", "--model", str(tiny_model_path), *FLAGS, "--replicas", "2", "--replica-cpus", "0.5"]
    proc, base = server_process.start(
        flags, entry=("-m", "app", "cluster"), env={"SLUICE_CACHE_DIR": str(CACHE_DIR)}, timeout=600
    )
    yield base
    server_process.stop(proc, timeout=90)


@pytest.fixture(scope="module")
def single(tiny_model_path) -> Iterator[str]:
    """The same model and flags in one plain server: what the cluster must answer like."""
    yield from serve("--model", str(tiny_model_path), *FLAGS)


@pytest.fixture(scope="module")
def replica_loads(cluster):
    """What the replicas report to the router, read through a handle from this process as a Ray driver: one
    replica's figures per call, whichever the router picks."""
    import ray
    from ray import serve

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    handle = serve.get_deployment_handle("EngineReplica", "sluice")
    yield lambda: [handle.record_routing_stats.remote().result() for _ in range(8)]
    ray.shutdown()


def model(base: str) -> str:
    return httpx.get(f"{base}/v1/models").json()["data"][0]["id"]


def test_the_openai_sdk_streams_through_the_cluster(cluster):
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=model(cluster), messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model(cluster), messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    body = {"model": model(cluster), "messages": messages, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/chat/completions", json=body, timeout=60) as response:
        events = read_events(response)
    assert events[-1].data == "[DONE]"
    assert events[-2].json()["choices"][0]["finish_reason"] is not None


def conversations(base: str) -> list[list[tuple[int, int]]]:
    """Three 4-turn conversations, their turns interleaved: each turn's (prompt_tokens, cached_tokens)."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    histories = [
        [{"role": "system", "content": f"You are assistant number {n}; answer in one line."}] for n in range(3)
    ]
    usage: list[list[tuple[int, int]]] = [[] for _ in histories]
    for turn in range(4):
        for n, history in enumerate(histories):
            history.append({"role": "user", "content": f"Question {turn} of conversation {n}: say something."})
            reply = client.chat.completions.create(model=model(base), messages=history, max_tokens=8, temperature=0)
            usage[n].append((reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens))
            # A fixed reply: the next prompt does not depend on what the model said.
            history.append({"role": "assistant", "content": "Noted, and here is my answer."})
    return usage


def test_a_conversation_finds_its_prefix_cached_as_on_one_replica(cluster, single):
    on_one = conversations(single)
    assert all(cached > 0 for turns in on_one for _, cached in turns[1:])
    assert conversations(cluster) == on_one


def test_a_continued_stored_response_reaches_its_replica(cluster, single):
    def cached(base: str) -> int:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        first = client.responses.create(model=model(base), input="Remember the number seven.", max_output_tokens=8)
        second = client.responses.create(
            model=model(base), input="Which number?", previous_response_id=first.id, max_output_tokens=8
        )
        for response in (first, second):
            assert httpx.delete(f"{base}/v1/responses/{response.id}").status_code == 200
        return second.usage.input_tokens_details.cached_tokens

    expected = cached(single)
    assert expected > 0
    assert cached(cluster) == expected


def test_a_stream_resumes_through_the_cluster(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    expected = httpx.post(f"{cluster}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.stream(
        "POST", f"{cluster}/v1/completions", json={**body, "stream": True, "resumable": True}, timeout=60
    ) as response:
        lines = response.iter_lines()
        first = parse_events(next(lines) for _ in range(6))
    time.sleep(0.5)  # generation goes on while nobody listens
    completion_id = first[0].json()["id"]
    with httpx.stream(
        "GET", f"{cluster}/v1/streams/{completion_id}", headers={"Last-Event-ID": first[-1].id}, timeout=60
    ) as response:
        assert response.status_code == 200
        rest = read_events(response)
    ids = [int(e.id) for e in first + rest]
    assert ids == list(range(1, len(ids) + 1))
    assert rest[-1].data == "[DONE]"
    text = "".join(c["text"] for e in first + rest if e.data.startswith("{") for c in e.json()["choices"])
    assert text == expected


def test_delete_cancels_a_stream_through_the_cluster(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        head = [next(lines) for _ in range(3)]
        completion_id = json.loads(head[1].removeprefix("data: "))["id"]
        deleted = httpx.delete(f"{cluster}/v1/streams/{completion_id}")
        assert deleted.status_code == 200
        events = parse_events([*head, *lines])
    assert events[-1].data == "[DONE]"
    assert events[-2].json()["error"]["code"] == "cancelled"
    assert len(events) < 900
    assert httpx.get(f"{cluster}/health").json()["num_running"] == 0


def test_a_client_gone_cancels_on_its_replica(cluster, replica_loads):
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        [next(lines) for _ in range(3)]
        assert any(load["num_requests"] == 1 and load["kv_used"] > 0 for load in replica_loads())
    deadline = time.monotonic() + 15
    while any(load["num_requests"] or load["kv_used"] for load in replica_loads()):
        assert time.monotonic() < deadline, "the replica still holds the request"
        time.sleep(0.2)
    assert httpx.get(f"{cluster}/health").json()["num_running"] == 0
