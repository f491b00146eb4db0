"""Autoscaling of `sluice cluster`'s engine replicas on their ongoing requests: a local Ray cluster of its own, 1
ingress replica over 1 to 2 engine replicas of a tiny random Llama, started once for this module. One ingress
replica is reached through HAProxy rather than Serve's proxy (tests/e2e/test_cluster.py's two): streams, the
OpenAI SDK and a client's leaving go through it as through the proxy. Under load a second replica starts and
takes streams; with the load gone autoscaling takes it away, and a stream it runs then still ends with [DONE].
The last test starts where the one before leaves the cluster (2 replicas)."""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from app import server_process
from app.sse_reader import Event
from tests.conftest import CACHE_DIR
from tests.e2e import test_cluster
from tests.e2e.test_cluster import FLAGS, health, homed_prompt, long_stream, wait_for

pytest.importorskip("ray.serve", reason="the cluster needs the `ray` extra")
pytestmark = [pytest.mark.slow, pytest.mark.cluster]

# A target of 2 ongoing requests per replica: LOAD streams want 2 replicas (twice the target on one), and the
# relay of the scale-down (1 to 2 streams, 1.5 on average) wants 1 with a margin: at a target of 1, its one
# stream would sit exactly on the target, where Ray's rounding of a window's mean decides.
LOAD = 4
AUTOSCALING_FLAGS = (
    "--replicas", "1", "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2",
    "--upscale-delay-s", "1", "--downscale-delay-s", "5",
    "--replica-cpus", "0.5", "--ingress-replicas", "1", "--shutdown-timeout", "60",
)  # fmt: skip
# long_stream's tokens, which the tiny model writes in 1 to 5 s on 2 cores: the load is streams back to back, not a
# few long ones.
MAX_TOKENS = 900


@pytest.fixture(scope="module")
def cluster(tiny_model_path) -> Iterator[str]:
    """`sluice cluster` with autoscaling, Ray's files in a folder of their own: under `make test`'s two workers
    tests/e2e/test_cluster.py's cluster may run beside this one, and its `ray.init(address="auto")` finds the
    cluster whose address was written last in that folder. Short, for the unix sockets Ray puts in it."""
    ray_dir = tempfile.mkdtemp(prefix="ray-")
    flags = ["--device", "cpu", "--model", str(tiny_model_path), *FLAGS, *AUTOSCALING_FLAGS]
    proc, base = server_process.start(
        flags,
        entry=("-m", "app", "cluster"),
        env={"SLUICE_CACHE_DIR": str(CACHE_DIR), "RAY_TMPDIR": ray_dir},
        timeout=600,
    )
    yield base
    server_process.stop(proc, timeout=90)
    shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def first_replica(cluster) -> str:
    """The engine replica the cluster starts with, before any load."""
    (replica,) = health(cluster)["replicas"]
    return replica


@dataclass
class Stream:
    events: list[Event] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    ended: dict[str, float] = field(default_factory=dict)


def assert_completed(stream: Stream) -> None:
    """Every token, the finish reason and [DONE]: no error event, and nothing cut short."""
    assert stream.events[-1].data == "[DONE]"
    payloads = [event.json() for event in stream.events[:-1]]
    assert not [p for p in payloads if "error" in p], [p["error"] for p in payloads if "error" in p]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["timings"]["predicted_n"] == MAX_TOKENS


def started(base: str, prompt: str) -> tuple[Stream, threading.Thread]:
    """A resumable MAX_TOKENS-token completion stream of `prompt`, read on a thread."""
    stream = Stream()
    return stream, long_stream(base, prompt, stream.events, stream.ended)


@contextmanager
def steady_load(base: str, streams: list[Stream]) -> Iterator[None]:
    """LOAD streams running at all times until the block ends (each of LOAD threads starts its next as its last
    ends), every one kept in `streams`; the block's exit waits for the streams running then. Each prompt's first
    block is new, so its home decides its replica: with two, about half of them go to each."""
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            stream, reader = started(base, f"{uuid.uuid4().hex} once upon a time there was a story")
            streams.append(stream)
            reader.join(timeout=120)

    workers = [threading.Thread(target=worker) for _ in range(LOAD)]
    for thread in workers:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in workers:
            thread.join(timeout=120)
            assert not thread.is_alive(), "a stream hangs"


def haproxy_configs() -> list[str]:
    """The config files of the HAProxy processes running here."""
    configs = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
            if Path(args[0]).name == "haproxy" and "-f" in args:
                configs.append(Path(args[args.index("-f") + 1]).read_text())
        except (OSError, IndexError):  # the process ended meanwhile
            continue
    return configs


def test_one_ingress_replica_is_reached_through_haproxy(cluster, first_replica):
    """Ray Serve's HAProxy on the cluster's port; streams, the SDK and a client gone as through Serve's proxy."""
    port = cluster.rsplit(":", 1)[1]
    assert [config for config in haproxy_configs() if re.search(rf"^\s*bind \S*:{port}\b", config, re.M)]
    test_cluster.test_the_openai_sdk_streams_through_the_cluster(cluster)
    test_cluster.test_a_client_gone_cancels_on_its_replica(cluster)


def test_under_load_a_second_replica_starts_and_takes_streams(cluster, first_replica):
    streams: list[Stream] = []
    with steady_load(cluster, streams):
        wait_for(lambda: health(cluster)["num_replicas"] == 2, 90, "a second replica under load")
        (added,) = set(health(cluster)["replicas"]) - {first_replica}
        # The replicas publish their figures every second: a request that reached the new one shows there.
        wait_for(lambda: health(cluster)["replicas"][added]["prefix_cache_query_tokens"] > 0, 30, "the new one serves")
    for stream in streams:
        assert_completed(stream)


def test_with_the_load_gone_it_scales_down_and_the_replica_taken_away_drains_its_stream(
    cluster, first_replica, tiny_tokenizer
):
    """Ray Serve takes the newest replica away first: streams homed on it run one after another, each started
    two thirds of the way through the one before (or at its end), so one is running there whenever it goes,
    1.5 on average. Each of them, the one it drains and those then sent to the other replica, runs to its end."""
    replicas = sorted(health(cluster)["replicas"])
    assert len(replicas) == 2, "the test above leaves 2 replicas"
    (added,) = [r for r in replicas if r != first_replica]
    streams: list[Stream] = []
    readers: list[threading.Thread] = []

    def gone() -> bool:
        return health(cluster)["num_replicas"] == 1

    deadline = time.monotonic() + 90
    while not gone():
        assert time.monotonic() < deadline, "the scale-down: not within 90 s"
        stream, reader = started(cluster, homed_prompt(tiny_tokenizer, added, replicas))
        streams.append(stream)
        readers.append(reader)
        while not (gone() or stream.ended or len(stream.events) >= 2 * MAX_TOKENS // 3):
            time.sleep(0.05)
    left = time.monotonic()
    assert set(health(cluster)["replicas"]) == {first_replica}, "the newest replica went"
    for reader in readers:
        reader.join(timeout=90)
        assert not reader.is_alive(), "a stream hangs"
    assert [s for s in streams if s.started < left < s.ended["at"]], "no stream was running when the replica left"
    for stream in streams:
        assert_completed(stream)
