"""CacheAwareRouter's choices, without a cluster: replicas stand in as their id and routing stats."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the cluster needs the `ray` extra")

from app.cluster.router import CacheAwareRouter, block_hashes, engine_stats, home_of, routing_stats  # noqa: E402
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


def busy(replica: Replica, requests: int) -> None:
    """The replica holding `requests` another ingress replica sent it, as it publishes them."""
    replica.routing_stats = routing_stats(replace(engine_stats({}), num_running=requests), {"ingress-2": requests})


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
    busy(first, 3)
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
    busy(owner, 10)
    assert route(r, [a, b], pending([*range(8), 60, 61, 62, 63])) is other
    assert r.decisions["fallback"] == 1
    continued = SamplingParams(max_tokens=1, continues="resp_1")
    assert route(r, [a, b], pending([*range(8), 80, 81, 82, 83], continued)) is owner
    assert route(r, [a, b], pending("resp_1", method="unpin")) is owner


def test_a_prefix_sent_to_several_replicas_goes_to_the_least_loaded_of_them():
    """A system prompt that has reached two replicas (the second took a conversation while the first was
    busy): new conversations after it go to whichever of the two is the less loaded, not to the one it
    reached last, so that imbalance does not build up and push later turns off their own replica."""
    r = router(imbalance=4)
    a, b, c = replicas("a", "b", "c")
    system = list(range(8))
    first = route(r, [a, b, c], pending([*system, 40, 41, 42, 43], request_id="1"))
    busy(first, 9)
    second = route(r, [a, b, c], pending([*system, 50, 51, 52, 53], request_id="2"))
    assert second is not first and r.decisions["fallback"] == 1
    third = next(x for x in (a, b, c) if x not in (first, second))
    # The first now less loaded than the second, which the system prompt reached last; the third, idle,
    # holds none of it and is within the imbalance.
    busy(first, 1)
    busy(second, 3)
    assert route(r, [a, b, c], pending([*system, 60, 61, 62, 63], request_id="3")) is first
    busy(second, 0)
    assert route(r, [a, b, c], pending([*system, 70, 71, 72, 73], request_id="4")) is second
    assert third.routing_stats == {} and r.decisions["affinity"] == 2


def test_a_long_conversation_tolerates_one_more_request_of_imbalance_for_each_block_a_move_would_compute():
    r = router(imbalance=4)
    a, b = replicas("a", "b")
    history = list(range(24))  # 6 blocks of 4
    owner = route(r, [a, b], pending(history, request_id="1"))
    other = b if owner is a else a
    # The other replica holds none of it: a move would compute 6 blocks, so 4 + 6 more requests are borne.
    busy(owner, 10)
    assert route(r, [a, b], pending([*history, 90, 91, 92, 93], request_id="2")) is owner
    busy(owner, 11)
    assert route(r, [a, b], pending([*history, 94, 95, 96, 97], request_id="3")) is other
    assert r.decisions["affinity"] == 1 and r.decisions["fallback"] == 1
    # Now both hold the history's 6 blocks: the next turn's move computes only what the owner alone was sent.
    busy(other, 0)
    busy(owner, 6)
    assert route(r, [a, b], pending([*history, 90, 91, 92, 93, 7, 7, 7, 7], request_id="4")) is other


def test_a_burst_chosen_for_before_any_is_routed_spreads_and_each_choice_counts_until_routed():
    r = router(imbalance=2)
    a, b = replicas("a", "b")
    burst = [pending([*range(8), 100 + i, 0, 0, 0], request_id=str(i)) for i in range(8)]
    chosen = [asyncio.run(r.choose_replicas([a, b], request))[0][0] for request in burst]
    # Eight new prompts of one home: that one takes them until it holds more than 2 over the other.
    assert sorted(chosen.count(x) for x in (a, b)) == [3, 5]
    assert sum(r.chosen_count.values()) == 8
    # Chosen again (all replicas refused it) replaces the earlier choice; routed, it counts as in flight.
    asyncio.run(r.choose_replicas([a, b], burst[0]))
    assert sum(r.chosen_count.values()) == 8
    for request, replica in zip(burst, chosen):
        r.on_request_routed(request, replica.replica_id, None)
    assert sum(r.chosen_count.values()) == 0 and sum(r.in_flight.values()) == 8


def test_a_load_is_this_router_s_own_count_and_the_other_ingresses_as_published():
    """A replica's published figures are up to a second old: this router's share of them is its own exact
    count instead (requests that ended since, a turn of conversations ending together, do not count),
    the other ingress replicas' shares are what the replica published."""
    r = router()
    a, b = replicas("a", "b")
    stale = replace(engine_stats({}), num_running=20)
    a.routing_stats = routing_stats(stale, {r.origin: 20})
    b.routing_stats = routing_stats(replace(stale, num_running=5), {r.origin: 3, "ingress-2": 2})
    assert (r.load(a), r.load(b)) == (0, 2)
    request = pending(list(range(8)), request_id="x")
    asyncio.run(r.choose_replicas([a, b], request))
    chosen = a if r.chosen_count[a.replica_id] else b
    r.on_request_routed(request, chosen.replica_id, None)
    assert r.load(chosen) == (1 if chosen is a else 3)
