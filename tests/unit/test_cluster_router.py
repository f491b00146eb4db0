"""CacheAwareRouter's choices, without a cluster: replicas stand in as their id and routing stats."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the cluster needs the `ray` extra")

from app.cluster.router import CacheAwareRouter, block_hashes  # noqa: E402
from engine.types import SamplingParams  # noqa: E402


@dataclass
class Replica:
    replica_id: str
    routing_stats: dict = field(default_factory=dict)


def router(imbalance: int = 4) -> CacheAwareRouter:
    # Ray builds routers with a deployment's handle; the choices need only the state initialize_state makes.
    instance = CacheAwareRouter.__new__(CacheAwareRouter)
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


def test_a_conversation_follows_its_prefix_and_new_prompts_go_to_the_least_loaded():
    r = router()
    idle, busy = Replica("idle"), Replica("busy", {"num_requests": 3})
    first = route(r, [busy, idle], pending(list(range(8))))
    assert first is idle
    idle.routing_stats["num_requests"] = 5
    # The next turn extends the prompt: it goes where the first was, though that one is now the busier.
    assert route(r, [busy, idle], pending([*range(8), 50, 51, 52, 53, 54])) is idle
    # A prompt nobody has seen goes to the least-loaded.
    busy.routing_stats["num_requests"] = 0
    assert route(r, [busy, idle], pending([70, 71, 72, 73, 74])) is busy


def test_a_much_busier_owner_is_passed_over_but_a_pinned_conversation_is_not():
    r = router(imbalance=4)
    a, b = Replica("a"), Replica("b", {"num_requests": 1})
    stored = SamplingParams(max_tokens=1, keep_kv_as="resp_1")
    assert route(r, [a, b], pending(list(range(8)), stored)) is a
    a.routing_stats["num_requests"] = 10
    assert route(r, [a, b], pending([*range(8), 60, 61, 62, 63])) is b
    assert r.num_fallbacks == 1
    continued = SamplingParams(max_tokens=1, continues="resp_1")
    assert route(r, [a, b], pending([*range(8), 80, 81, 82, 83], continued)) is a
    assert route(r, [a, b], pending("resp_1", method="unpin")) is a
