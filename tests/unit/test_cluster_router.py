"""CacheAwareRouter's choices, without a cluster: replicas stand in as their id and routing stats."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the cluster needs the `ray` extra")

from app.cluster.router import CacheAwareRouter, block_hashes, home_of  # noqa: E402
from engine.types import SamplingParams  # noqa: E402


@dataclass(frozen=True)
class Id:
    unique_id: str


@dataclass
class Replica:
    replica_id: Id
    routing_stats: dict = field(default_factory=dict)


def replicas(*names: str) -> list[Replica]:
    return [Replica(Id(name)) for name in names]


def router(imbalance: int = 4) -> CacheAwareRouter:
    # Ray builds routers with a deployment's handle; the choices need only the state initialize_state makes,
    # and the router registers itself under its application's name (for the ingress's metrics).
    instance = CacheAwareRouter.__new__(CacheAwareRouter)
    instance._deployment_id = SimpleNamespace(app_name="test", name="replica")
    instance.initialize_state(block_size=4, imbalance=imbalance)
    return instance


def pending(prompt: list[int], params: SamplingParams | None = None, method: str = "generate", request_id="r"):
    args = [prompt] if method == "unpin" else [request_id, prompt, params or SamplingParams(max_tokens=1)]
    return SimpleNamespace(args=args, metadata=SimpleNamespace(call_method=method, internal_request_id=request_id))


def route(r: CacheAwareRouter, replicas: list[Replica], request) -> Replica:
    ranks = asyncio.run(r.choose_replicas(replicas, request))
    chosen = ranks[0][0]
    r.on_request_routed(request, chosen.replica_id, None)
    r.on_request_completed(chosen.replica_id, request.metadata.internal_request_id)
    return chosen


def test_block_hashes_agree_exactly_as_far_as_the_prefixes_do():
    a, b = block_hashes(list(range(10)), 4), block_hashes([*range(6), 99, 7, 8, 9, 10, 11], 4)
    assert len(a) == 2 and len(b) == 3
    assert a[0] == b[0] and a[1] != b[1]


def test_a_conversation_follows_its_prefix_and_a_new_prompt_goes_to_its_home_replica():
    r = router()
    a, b = replicas("a", "b")
    prompt = list(range(8))
    home = home_of(block_hashes(prompt, 4)[0], ["a", "b"])
    first = route(r, [a, b], pending(prompt))
    assert first.replica_id.unique_id == home
    # The next turn extends the prompt: it goes where the first was, though that one is now the busier.
    first.routing_stats["num_running"] = 3
    assert route(r, [b, a], pending([*prompt, 50, 51, 52, 53, 54])) is first
    # A prompt nobody has seen goes to the replica its first block hashes to, whichever ingress routes it.
    new = list(range(70, 78))
    assert route(router(), [b, a], pending(new)).replica_id.unique_id == home_of(block_hashes(new, 4)[0], ["a", "b"])
    # One shorter than a block has no home: the least loaded takes it.
    assert route(r, [a, b], pending([90, 91, 92])) is (b if first is a else a)
    assert r.decisions["home"] == 1 and r.decisions["affinity"] == 1 and r.decisions["least_loaded"] == 1


def test_a_much_busier_owner_is_passed_over_but_a_pinned_conversation_is_not():
    r = router(imbalance=4)
    a, b = replicas("a", "b")
    stored = SamplingParams(max_tokens=1, keep_kv_as="resp_1")
    owner = route(r, [a, b], pending(list(range(8)), stored))
    other = b if owner is a else a
    owner.routing_stats["num_running"] = 10
    assert route(r, [a, b], pending([*range(8), 60, 61, 62, 63])) is other
    assert r.decisions["fallback"] == 1
    continued = SamplingParams(max_tokens=1, continues="resp_1")
    assert route(r, [a, b], pending([*range(8), 80, 81, 82, 83], continued)) is owner
    assert route(r, [a, b], pending("resp_1", method="unpin")) is owner
