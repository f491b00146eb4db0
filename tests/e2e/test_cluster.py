"""Sluice on Ray Serve (`sluice cluster`): a local Ray cluster of 2 ingress replicas over 2 engine replicas of a
tiny random Llama, started once for this module, against one plain server of the same model and flags. The
last three tests take replicas away (an ingress replica killed, an engine replica killed, then a scale-down):
they run last, on the same cluster."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from app import server_process
from app.sse_reader import Event, iter_events, parse_events, read_events
from tests.conftest import CACHE_DIR
from tests.e2e.conftest import serve

pytest.importorskip("ray.serve", reason="the cluster needs the `ray` extra")
pytestmark = [pytest.mark.slow, pytest.mark.cluster]

FLAGS = ("--max-model-len", "1024", "--kv-cache-gib", "0.05", "--max-num-seqs", "8")
CLUSTER_FLAGS = ("--replicas", "2", "--replica-cpus", "0.5", "--ingress-replicas", "2", "--shutdown-timeout", "60")
BLOCK_SIZE = 16  # the default --block-size, which the router hashes prompts by


@pytest.fixture(scope="module")
def cluster(tiny_model_path) -> Iterator[str]:
    """`sluice cluster`: Ray's start-up and the replicas take a minute or two on 2 cores."""
    flags = ["--device", "cpu", "--model", str(tiny_model_path), *FLAGS, *CLUSTER_FLAGS]
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
def ray_driver(cluster) -> Iterator[None]:
    """This process as a driver of the cluster's Ray, to take replicas away as an operator or a fault does."""
    import ray

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def model(base: str) -> str:
    return httpx.get(f"{base}/v1/models").json()["data"][0]["id"]


def health(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=10).json()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `condition` held, polled every 0.1 s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout:g} s"
        time.sleep(0.1)
    return time.monotonic() - start


def process_gone(pid: int) -> bool:
    """Whether the process `pid` (on this machine, as the local cluster's are) has exited."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


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
    with httpx.stream(
        "POST", f"{cluster}/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-1"}, timeout=60
    ) as response:
        events = read_events(response)
    assert response.headers.get_list("x-request-id") == ["trace-1"]
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
    """Whichever ingress replica each turn reaches: their routers agree on the replica of a new prefix."""
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


def by_ingress(make: Callable[[], str]) -> dict[str, str]:
    """An id made by each ingress replica (the one that made an id is the tag it ends with)."""
    made: dict[str, str] = {}
    for _ in range(30):
        made_id = make()
        made.setdefault(made_id.rpartition(".")[2], made_id)
        if len(made) == 2:
            return made
    raise AssertionError(f"every id came from one ingress replica: {made}")


def finished_stream(base: str) -> str:
    """The id of a short resumable stream read to its end."""
    body = {"prompt": "Once upon a time", "max_tokens": 4, "stream": True, "resumable": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        return read_events(response)[0].json()["id"]


def test_ids_reach_the_ingress_replica_holding_them_from_either(cluster):
    """Each request below reaches either ingress replica (the Serve proxy picks one at random), so about half
    of them are forwarded to the other, the one holding the id: every one must find what it addresses."""

    stored: list[str] = []

    def stored_response() -> str:
        body = {"input": "Remember the number seven.", "max_output_tokens": 4}
        stored.append(httpx.post(f"{cluster}/v1/responses", json=body, timeout=60).json()["id"])
        return stored[-1]

    for tag, response_id in by_ingress(stored_response).items():
        for _ in range(8):
            got = httpx.get(f"{cluster}/v1/responses/{response_id}", timeout=30)
            assert got.status_code == 200 and got.json()["id"] == response_id
        body = {"input": "Which number?", "max_output_tokens": 4, "previous_response_id": response_id}
        for _ in range(2):
            follow_up = httpx.post(f"{cluster}/v1/responses", json=body, timeout=60).json()
            # Made where its predecessor is held, and computed where its KV is pinned.
            assert follow_up["id"].endswith(f".{tag}")
            assert follow_up["usage"]["input_tokens_details"]["cached_tokens"] > 0
            assert httpx.delete(f"{cluster}/v1/responses/{follow_up['id']}").status_code == 200
    for response_id in stored:
        assert httpx.delete(f"{cluster}/v1/responses/{response_id}").status_code == 200
        assert httpx.get(f"{cluster}/v1/responses/{response_id}").status_code == 404
    for completion_id in by_ingress(lambda: finished_stream(cluster)).values():
        for _ in range(4):
            with httpx.stream("GET", f"{cluster}/v1/streams/{completion_id}", timeout=30) as response:
                assert response.status_code == 200
                events = read_events(response)
            assert events[0].json()["id"] == completion_id and events[-1].data == "[DONE]"
        assert httpx.delete(f"{cluster}/v1/streams/{completion_id}").status_code == 200
        assert httpx.get(f"{cluster}/v1/streams/{completion_id}").status_code == 404
    # An id whose ingress replica is gone.
    for gone in (
        httpx.get(f"{cluster}/v1/streams/cmpl-{uuid.uuid4().hex}.gone"),
        httpx.post(f"{cluster}/v1/responses", json={"input": "Hi", "previous_response_id": "resp_1.gone"}),
    ):
        assert gone.status_code == 410
        assert gone.json()["error"]["code"] == "replica_gone"


def test_delete_cancels_a_stream_through_the_cluster(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    for _ in range(2):  # each DELETE may reach the other ingress replica
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


def test_a_client_gone_cancels_on_its_replica(cluster):
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        [next(lines) for _ in range(3)]
        wait_for(lambda: health(cluster)["num_running"] == 1, 10, "a replica reports the request")
        assert health(cluster)["kv_blocks_used"] > health(cluster)["kv_blocks_pinned"]
    # The replicas publish their figures every second; blocks pinned for stored responses are not the request's.
    wait_for(
        lambda: (h := health(cluster))["num_running"] == 0 and h["kv_blocks_used"] == h["kv_blocks_pinned"],
        15,
        "the replica drops the request and frees its KV",
    )


def test_health_and_metrics_show_each_replica_and_the_routing(cluster):
    body = health(cluster)
    assert body["status"] == "ok" and body["num_replicas"] == 2
    replicas = body["replicas"]
    assert len(replicas) == 2 and all(r["alive"] and r["kv_blocks_total"] > 0 for r in replicas.values())
    # The conversations above found their prefixes on their replicas.
    assert body["prefix_cache_hit_tokens"] == sum(r["prefix_cache_hit_tokens"] for r in replicas.values()) > 0
    metrics = httpx.get(f"{cluster}/metrics").text
    for replica in replicas:
        assert f'sluice:num_requests_running{{model_name="{model(cluster)}",replica="{replica}"}}' in metrics
        assert f'sluice:prefix_cache_hits_total{{model_name="{model(cluster)}",replica="{replica}"}}' in metrics
    # Each ingress replica counts its own decisions; either routed turns of the conversations above.
    decisions = {
        line.split('decision="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("sluice:routing_decisions_total{")
    }
    assert decisions.get("affinity", 0) > 0 and decisions.get("home", 0) > 0


def homed_prompt(tiny_tokenizer, replica: str, replicas: list[str]) -> str:
    """A prompt no replica has seen whose first block's home is `replica`: where the router sends it."""
    from app.cluster.router import block_hashes, home_of
    from app.serving.prompting import text_prompt_ids

    while True:
        prompt = f"{uuid.uuid4().hex} once upon a time there was a story of many words and more words"
        if home_of(block_hashes(text_prompt_ids(tiny_tokenizer, prompt), BLOCK_SIZE)[0], replicas) == replica:
            return prompt


def long_stream(base: str, prompt: str, events: list[Event], ended: dict[str, float]) -> threading.Thread:
    """A resumable 900-token stream, read on a thread into `events`; `ended["at"]` its end's monotonic time."""

    def read() -> None:
        body = {"prompt": prompt, "max_tokens": 900, "ignore_eos": True, "stream": True, "resumable": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
            events.extend(iter_events(response.iter_lines()))
        ended["at"] = time.monotonic()

    thread = threading.Thread(target=read)
    thread.start()
    return thread


def test_the_ids_of_a_killed_ingress_replica_get_410_and_the_cluster_serves_on(cluster, ray_driver):
    """An ingress replica holds its streams' logs and stored responses: killed, what it held went with it, and a
    resume of one of its streams gets 410 from the other (or its replacement), not a hang; new requests are
    answered meanwhile."""
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    held = by_ingress(lambda: finished_stream(cluster))
    victim, completion_id = sorted(held.items())[0]
    name = ReplicaID(victim, DeploymentID(name="SluiceIngress", app_name="sluice")).to_full_id_str()
    actor = ray.get_actor(name, namespace="serve")
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    ray.kill(actor, no_restart=True)
    # Ray marks the actor dead before its process ends, and until then the replica still answers (a resume:
    # 200), so the test waits for the process itself.
    wait_for(lambda: process_gone(pid), 30, "the killed ingress replica's process gone")
    answers: list[httpx.Response] = []

    def resumed_gone() -> bool:
        # Until Ray's proxy stops sending to the dead replica, a request may fail on the way there.
        try:
            answers.append(httpx.get(f"{cluster}/v1/streams/{completion_id}", timeout=10))
        except httpx.TransportError:
            return False
        return answers[-1].status_code == 410

    wait_for(resumed_gone, 30, "a resume of the killed replica's stream answered 410")
    assert answers[-1].json()["error"]["code"] == "replica_gone"
    assert {a.status_code for a in answers} <= {410, 500, 502, 503}, [a.status_code for a in answers]
    answered = httpx.post(f"{cluster}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
    assert answered.status_code == 200
    # The other ingress replica's stream is untouched.
    (other,) = [i for tag, i in held.items() if tag != victim]
    with httpx.stream("GET", f"{cluster}/v1/streams/{other}", timeout=30) as response:
        assert response.status_code == 200 and read_events(response)[-1].data == "[DONE]"


def test_a_killed_replica_ends_its_streams_and_ray_replaces_it(cluster, ray_driver, tiny_tokenizer):
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    replicas = sorted(health(cluster)["replicas"])
    victim = replicas[0]
    events: list[Event] = []
    ended: dict[str, float] = {}
    reader = long_stream(cluster, homed_prompt(tiny_tokenizer, victim, replicas), events, ended)
    wait_for(lambda: len(events) >= 2, 30, "the stream's first events")
    name = ReplicaID(victim, DeploymentID(name="EngineReplica", app_name="sluice")).to_full_id_str()
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    killed = time.monotonic()
    reader.join(timeout=60)
    assert not reader.is_alive(), "the stream hangs"
    assert ended["at"] - killed < 10
    assert events[-1].data == "[DONE]"
    assert "replica" in events[-2].json()["error"]["message"], events[-2].data
    # Meanwhile new requests go to the other replica.
    answered = httpx.post(f"{cluster}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
    assert answered.status_code == 200
    # The stream's log outlived its replica: a resume replays it to its error and [DONE], no hang.
    completion_id = events[0].json()["id"]
    with httpx.stream("GET", f"{cluster}/v1/streams/{completion_id}", timeout=30) as response:
        assert response.status_code == 200
        assert [e.data for e in read_events(response)] == [e.data for e in events]
    wait_for(lambda: (h := health(cluster))["num_replicas"] == 2 and victim not in h["replicas"], 180, "a new replica")


def test_a_replica_scaled_down_drains_its_streams(cluster, ray_driver, tiny_tokenizer):
    """Taken away (as autoscaling or an operator's external scaler does), a replica is sent nothing new and its
    stream runs to its end, [DONE] and all, within --shutdown-timeout."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    replicas = sorted(health(cluster)["replicas"])
    streams = [([], {}) for _ in replicas]
    readers = [
        long_stream(cluster, homed_prompt(tiny_tokenizer, replica, replicas), events, ended)
        for replica, (events, ended) in zip(replicas, streams)
    ]
    wait_for(lambda: all(len(events) >= 2 for events, _ in streams), 30, "both streams' first events")
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name="EngineReplica", app_name="sluice"), 1))
    wait_for(lambda: health(cluster)["num_replicas"] == 1, 30, "the replica leaves the serving set")
    assert not any(ended for _, ended in streams), "both streams had to be running when the replica left"
    answered = httpx.post(f"{cluster}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
    assert answered.status_code == 200
    for reader in readers:
        reader.join(timeout=90)
        assert not reader.is_alive()
    for events, _ in streams:
        assert events[-1].data == "[DONE]"
        last = events[-2].json()
        assert last["choices"][0]["finish_reason"] == "length" and last["timings"]["predicted_n"] == 900
