"""The Ray Serve request routers of a cluster's deployments.

CacheAwareRouter, the engine replicas': a prompt goes to the replica this router sent the longest run of its
leading KV blocks (a conversation's earlier turns), the least loaded of them where several were (a shared
system prompt that has reached more than one); a prompt it has not seen goes to its first block's home, the
replica that block hashes to (rendezvous hashing over the serving replicas), so every ingress replica's
router sends a new conversation's turns to the same replica without sharing state. Either goes instead to
the least-loaded replica when it holds `imbalance` more requests than that one, plus one for each block of
the prompt the move would compute anew (a long conversation stays where its KV is, unless its replica is
far busier); so does a prompt shorter than a block. A request that continues a stored response
(`previous_response_id`) goes where that response's KV is pinned, and unpinning it goes there too.

PowerOfTwoRouter: Ray Serve's default policy, for comparison.

IngressRouter, the ingress replicas': a forwarded request (app/cluster/forwarding.py) goes to the ingress
replica its id names; everything else, as Ray's default router does, to the shorter queue of two.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import Counter, OrderedDict
from dataclasses import fields

from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from app.cluster import router_registry
from engine.config import EngineStats
from engine.types import SamplingParams

_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))


def routing_stats(stats: EngineStats, held_for: dict[str, int]) -> dict[str, float]:
    """What a replica publishes to the routers (Ray Serve's routing stats, numbers only): all its stats, and
    how many of its requests each ingress replica sent it (by the ingress's id)."""
    return {
        **{name: float(getattr(stats, name)) for name in _STATS_FIELDS},
        **{_HELD_FOR + origin: float(count) for origin, count in held_for.items()},
    }


# The routing stats' key of the requests one ingress replica has on an engine replica.
_HELD_FOR = "held_for:"


def engine_stats(published: dict[str, float]) -> EngineStats:
    """A replica's stats from what it published; before it first did, a replica Ray runs is taken as alive
    and idle."""
    return EngineStats(
        alive=bool(published.get("alive", True)),
        **{name: kind(published.get(name, 0)) for name, kind in _NUMBERS.items()},
    )


# Every figure but `alive`, by the type it has in EngineStats.
_NUMBERS = {f.name: int if f.type in ("int", int) else float for f in fields(EngineStats) if f.name != "alive"}


def block_hashes(prompt_token_ids: list[int], block_size: int) -> list[int]:
    """One hash per full block of the prompt, each over the blocks before it too (as the prefix cache
    keys its blocks): equal hashes mean equal prefixes up to that block."""
    hashes = []
    previous = 0
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        previous = hash((previous, *prompt_token_ids[start : start + block_size]))
        hashes.append(previous)
    return hashes


class _Lru(OrderedDict):
    """A bounded map that forgets what was used longest ago."""

    def __init__(self, max_entries: int) -> None:
        super().__init__()
        self.max_entries = max_entries

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.max_entries:
            self.popitem(last=False)


def ingress_origin() -> str:
    """The id of the ingress replica this process is, under which engine replicas count its requests; ""
    outside a Serve replica (a driver's handle)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return ""


def home_of(first_block: int, replicas: list[str]) -> str:
    """The replica (by id) a prompt's first block hashes to: the one whose hash with it is highest (rendezvous
    hashing), the same in every process; when a replica leaves, only the blocks homed on it move."""
    return max(
        replicas, key=lambda replica: hashlib.blake2b(f"{first_block}:{replica}".encode(), digest_size=8).digest()
    )


def _home(candidates: list[RunningReplica], first_block: int) -> RunningReplica:
    home = home_of(first_block, [r.replica_id.unique_id for r in candidates])
    return next(r for r in candidates if r.replica_id.unique_id == home)


# Seconds a choice counts towards its replica's load while the request waits to be routed there: routing
# follows a choice within milliseconds, or Ray chooses again (all replicas full), which replaces it.
CHOICE_TTL_S = 5.0


class CacheAwareRouter(RequestRouter):
    """Ranks the replica holding a request's prefix (or its pinned conversation) first, then the others by load."""

    def initialize_state(self, block_size: int = 16, imbalance: int = 4, max_entries: int = 100_000) -> None:
        self.block_size = block_size
        self.imbalance = imbalance
        # The ingress replica this router routes for: what the engine replicas count its requests under.
        self.origin = ingress_origin()
        # The replicas each prompt block was sent to, and where each stored response's KV is pinned.
        self.block_holders: _Lru = _Lru(max_entries)
        self.pin_owner: _Lru = _Lru(max_entries)
        # Requests this router sent and that have not completed, per replica: fresher than routing stats.
        self.in_flight: dict[ReplicaID, int] = {}
        self.in_flight_ids: dict[str, ReplicaID] = {}
        # Requests chosen for a replica and not yet routed there, oldest first: a burst of requests is chosen
        # for before the first of them is routed, and without these every one of them would see the same
        # loads and go to the same replica.
        self.chosen: dict[str, tuple[ReplicaID, float]] = {}
        self.chosen_count: Counter[ReplicaID] = Counter()
        # Routing decisions, by kind (see app/operations/metrics.py's sluice:routing_decisions).
        self.decisions: Counter[str] = Counter()
        self._decided: _Lru = _Lru(max_entries)
        router_registry.register(self.app_name, self)

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each serving replica's stats as it last published them (every second), by replica id."""
        return {r.replica_id.unique_id: engine_stats(r.routing_stats) for r in self.curr_replicas.values()}

    def load(self, replica: RunningReplica) -> int:
        """Requests on the replica: what this router sent it and chose it for (exact, and current), and what the
        other ingress replicas' routers sent it as the replica last published (within a second). Not the
        replica's own total: published a second late, it would count requests that have ended since (a
        turn of conversations ending together) and send their next turns away from their KV."""
        published = replica.routing_stats
        mine = self.in_flight.get(replica.replica_id, 0) + self.chosen_count[replica.replica_id]
        own_key = _HELD_FOR + self.origin
        others = sum(count for key, count in published.items() if key.startswith(_HELD_FOR) and key != own_key)
        return mine + int(others)

    def _choose(self, request_id: str, replica_id: ReplicaID | None) -> None:
        """Note (or, with None, forget) the replica a request was chosen for until it is routed; a choice older
        than CHOICE_TTL_S (a request Ray never routed) stops counting."""
        if (previous := self.chosen.pop(request_id, None)) is not None:
            self.chosen_count[previous[0]] -= 1
        now = time.monotonic()
        while self.chosen:
            oldest, (replica, at) = next(iter(self.chosen.items()))
            if now - at < CHOICE_TTL_S:
                break
            del self.chosen[oldest]
            self.chosen_count[replica] -= 1
        if replica_id is not None:
            self.chosen[request_id] = (replica_id, now)
            self.chosen_count[replica_id] += 1

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        # Ties in random order: idle replicas share new prompts rather than the first taking them all.
        by_load = sorted(candidate_replicas, key=lambda r: (self.load(r), random.random()))
        if pending_request is None or not by_load:
            return [by_load] if by_load else []
        method, args = pending_request.metadata.call_method, pending_request.args
        preferred: RunningReplica | None = None
        decision = "least_loaded"
        # Blocks of the prompt the least-loaded replica would compute that the preferred one holds.
        lost_blocks = 0
        if method == "unpin":
            preferred, decision = self._replica(by_load, self.pin_owner.get(args[0])), "pinned"
        elif method == "generate":
            # generate(request_id, prompt_token_ids, params, images)
            prompt_token_ids, params = args[1], args[2]
            assert isinstance(params, SamplingParams)
            hashes = block_hashes(prompt_token_ids, self.block_size)
            if params.continues is not None and params.continues in self.pin_owner:
                preferred, decision = self._replica(by_load, self.pin_owner[params.continues]), "pinned"
            elif depths := self._held_depths(hashes, by_load):
                deepest = max(depths.values())
                preferred = next(r for r in by_load if depths.get(r.replica_id) == deepest)
                decision, lost_blocks = "affinity", deepest - depths.get(by_load[0].replica_id, 0)
            elif hashes:
                preferred, decision = _home(by_load, hashes[0]), "home"
        if preferred is None:
            decision, ranks = "least_loaded", [[by_load[0]], by_load[1:]]
        elif decision != "pinned" and self.load(preferred) > self.load(by_load[0]) + self.imbalance + lost_blocks:
            decision, ranks = "fallback", [[by_load[0]], by_load[1:]]
        else:
            ranks = [[preferred], [r for r in by_load if r is not preferred]]
        ranks = [rank for rank in ranks if rank]
        if method == "generate":
            # Counted once routed: a request whose replicas all refuse it is chosen for again.
            self._decided.put(pending_request.metadata.internal_request_id, decision)
            self._choose(pending_request.metadata.internal_request_id, ranks[0][0].replica_id)
        return ranks

    def _held_depths(self, hashes: list[int], candidates: list[RunningReplica]) -> dict[ReplicaID, int]:
        """How many of these leading blocks each candidate was sent, for those sent any: a block's hash covers
        the blocks before it, so whoever was sent the deepest one was sent them all."""
        live = {r.replica_id for r in candidates}
        depths: dict[ReplicaID, int] = {}
        for depth in range(len(hashes), 0, -1):
            for replica_id in self.block_holders.get(hashes[depth - 1], ()):
                if replica_id in live:
                    depths.setdefault(replica_id, depth)
            if len(depths) == len(live):
                break
        return depths

    @staticmethod
    def _replica(candidates: list[RunningReplica], replica_id: ReplicaID | None) -> RunningReplica | None:
        return next((r for r in candidates if r.replica_id == replica_id), None)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        metadata = pending_request.metadata
        self._choose(metadata.internal_request_id, None)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.in_flight_ids[metadata.internal_request_id] = replica_id
        if metadata.call_method != "generate":
            return
        if (decision := self._decided.pop(metadata.internal_request_id, None)) is not None:
            self.decisions[decision] += 1
        prompt_token_ids, params = pending_request.args[1], pending_request.args[2]
        for block_hash in block_hashes(prompt_token_ids, self.block_size):
            self.block_holders.put(block_hash, {**self.block_holders.get(block_hash, {}), replica_id: None})
        if params.keep_kv_as is not None:
            self.pin_owner.put(params.keep_kv_as, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight_ids.pop(internal_request_id, None) is not None:
            self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)


class PowerOfTwoRouter(CacheAwareRouter):
    """Ray Serve's default policy (two replicas at random, then the shorter queue, which Ray's probes pick),
    blind to prefixes and pins, kept a CacheAwareRouter for the replicas' figures /health and /metrics show:
    `--request-router power-of-two`, what cache-aware routing is measured against."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]


class IngressRouter(RequestRouter):
    """A forwarded request to the ingress replica its first argument names (or, that one gone, to any, which
    answers 410); any other request to the shorter queue of two at random, as Ray's default router does."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and pending_request.metadata.call_method == "forwarded":
            holder = pending_request.args[0]
            named = [r for r in candidate_replicas if r.replica_id.unique_id == holder]
            return [named or candidate_replicas]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
